"""hpcnft.run.batch, the logic behind slurm/*.sbatch: run dir defaults, word splitting of the
knobs, the launcher and hpcnft command lines, the ranks' environment, exit codes."""
from __future__ import annotations

import os
import signal

import pytest

from hpcnft.run import batch

SRUN = ["srun", "--kill-on-bad-exit=1", "--mpi=none"]


def test_words_group_and_escape_but_expand_nothing():
    text = "--set 'a=b c' \"x='y'\" a\\ b $(touch p) `id` ; | * ~ $HOME"
    assert batch.split_words(text, "HPCNFT_ARGS") == [
        "--set", "a=b c", "x='y'", "a b", "$(touch", "p)", "`id`", ";", "|", "*", "~", "$HOME"]
    assert batch.split_words("   ", "X") == []
    with pytest.raises(batch.BatchError, match="bad SRUN_ARGS"):
        batch.split_words("--x 'open", "SRUN_ARGS")


def test_run_dir_keeps_the_job_id_and_is_absolute(tmp_path):
    cwd = str(tmp_path)
    assert batch.run_dir({"SLURM_JOB_ID": "4242"}, cwd, 0, 1) == os.path.join(cwd, "runs", "4242")
    local = batch.run_dir({}, cwd, 0, 77)
    assert os.path.dirname(local) == os.path.join(cwd, "runs") and os.path.basename(local).startswith("local-")
    assert local.endswith("-77")
    assert batch.run_dir({"RUN_DIR": "a b/c"}, cwd, 0, 1) == os.path.join(cwd, "a b/c")
    assert batch.run_dir({"RUN_DIR": "/abs"}, cwd, 0, 1) == "/abs"


def test_hpcnft_command_defaults():
    assert batch.hpcnft_command({}, which=lambda name: "/x/hpcnft") == ["hpcnft"]
    assert batch.hpcnft_command({}, which=lambda name: None) == ["python3", "-P", "-m", "hpcnft"]
    assert batch.hpcnft_command({"HPCNFT_CMD": "'/opt/my env/python' -m hpcnft"}) == [
        "/opt/my env/python", "-m", "hpcnft"]


def test_launcher_inside_and_outside_slurm():
    assert batch.launcher({}, SRUN) == []  # hpcnft spawns the ranks itself
    job = {"SLURM_JOB_ID": "7", "SLURM_CPUS_PER_TASK": "2"}
    assert batch.launcher(job, SRUN) == [*SRUN, "--cpus-per-task=2", "--gpu-bind=none"]
    assert batch.launcher(job | {"GPU_BIND": ""}, SRUN) == [*SRUN, "--cpus-per-task=2"]
    assert batch.launcher(job | {"SRUN": ""}, SRUN) == []  # SRUN= runs the command directly
    assert batch.launcher(job | {"SRUN": "/x/srun -v", "SRUN_ARGS": "--exclusive --label"}, SRUN) == [
        "/x/srun", "-v", *SRUN[1:], "--cpus-per-task=2", "--gpu-bind=none", "--exclusive", "--label"]


def test_srun_starts_the_tasks_of_the_allocation_the_job_holds_now():
    """A job requeued onto fewer nodes keeps its first SLURM_NTASKS (3); SLURM_TASKS_PER_NODE
    says what it holds now (1 a node on 2 nodes), and srun is told so."""
    requeued = {"SLURM_JOB_ID": "7", "GPU_BIND": "", "SLURM_NTASKS": "3", "SLURM_TASKS_PER_NODE": "1(x2)"}
    assert batch.launcher(requeued, SRUN) == [*SRUN, "--ntasks=2"]
    assert batch.allocated_tasks({"SLURM_TASKS_PER_NODE": "2(x3),1"}) == 7
    assert batch.allocated_tasks({"SLURM_TASKS_PER_NODE": "weird"}) is None
    assert batch.allocated_tasks({}) is None
    assert batch.launcher(requeued | {"SRUN": "mpirun"}, SRUN)[-1] != "--ntasks=2"  # srun's option only


def test_command_line():
    env = {"RECIPE": "my recipe", "HPCNFT_ARGS": "--steps 3", "HPCNFT_CMD": "hpcnft"}
    assert batch.command(env, SRUN, "/r") == ["hpcnft", "run", "my recipe", "--run-dir", "/r", "--steps", "3"]


def test_ranks_get_one_thread_per_cpu_and_unbuffered_output():
    assert batch.child_env({"SLURM_CPUS_PER_TASK": "4"}) == {
        "SLURM_CPUS_PER_TASK": "4", "OMP_NUM_THREADS": "4", "PYTHONUNBUFFERED": "1"}
    assert batch.child_env({"OMP_NUM_THREADS": "8"})["OMP_NUM_THREADS"] == "8"


def test_a_killed_command_exits_as_in_the_shell():
    assert batch.exit_status(-signal.SIGTERM) == 128 + signal.SIGTERM
    assert batch.exit_status(3) == 3


def test_bad_knob_is_one_line_and_exit_2(tmp_path, capsys):
    rc = batch.run(SRUN, {"HPCNFT_ARGS": "'", "RUN_DIR": str(tmp_path / "r")}, str(tmp_path))
    assert rc == 2 and not (tmp_path / "r").exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad HPCNFT_ARGS" in err[0]
