"""hpcnft.run.submit: a submission is checked before anything is made (a run dir in use, an
unknown cluster), where no Slurm answers it is one line and exit 2 with nothing left on disk,
and --dry-run prints what would be submitted and creates nothing."""
from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest

from hpcnft.common.errors import UsageError
from hpcnft.io.rundir_lock import RunDirInUse, acquire
from hpcnft.run.submit import SLURM_COMMANDS, submit
from jobs import hpcnft


def test_a_run_dir_in_use_is_refused_before_anything_is_submitted(tmp_path):
    run_dir = str(tmp_path / "run")
    held = acquire(run_dir, pytest.fail)
    try:
        with pytest.raises(RunDirInUse, match=f"^run dir {run_dir} is in use by pid {os.getpid()} "):
            submit("tiny", cluster="debug", run_dir=run_dir, steps=1)
    finally:
        held.release()
    assert sorted(os.listdir(run_dir)) == [".lock"]  # no submitit folder: nothing was queued


def test_an_unknown_cluster_is_refused_before_the_run_dir_is_made(tmp_path):
    with pytest.raises(UsageError, match=r"^--cluster: 'nosuch' is not one of slurm, local, debug$"):
        submit("tiny", cluster="nosuch", run_dir=str(tmp_path / "run"), steps=1)
    assert os.listdir(tmp_path) == []


def _without_slurm() -> str:
    """PATH without the folders that hold sbatch or srun."""
    return os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and not any(os.path.exists(os.path.join(d, c)) for c in SLURM_COMMANDS))


def _one_line_refusal(r) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith("hpcnft submit: error: --cluster slurm: "), r.stderr
    return r.stderr


def test_without_slurm_submit_is_one_line_exit_2_and_makes_no_run_dir(tmp_path):
    run_dir = tmp_path / "deep" / "run"
    r = hpcnft("submit", "tiny", "--cluster", "slurm", "--run-dir", str(run_dir), check=False,
               env={"PATH": _without_slurm()})
    assert "no Slurm here (sbatch and srun not on PATH)" in _one_line_refusal(r)
    assert os.listdir(tmp_path) == []


def _dead_controller_conf(tmp_path: Path, sbatch: str, port: int) -> Path:
    """A slurm.conf whose controller is a port that refuses connections (auth/none: no munge needed)."""
    plugins = sorted(Path(sbatch).resolve().parents[1].glob("lib*/**/auth_none.so"))  # beside this sbatch
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=dead\nSlurmctldHost=localhost(127.0.0.1)\n"
                    f"SlurmctldPort={port}\nAuthType=auth/none\nCredType=cred/none\nMessageTimeout=2\n"
                    + (f"PluginDir={plugins[0].parent}\n" if plugins else "")
                    + "NodeName=localhost CPUs=1 State=UNKNOWN\nPartitionName=debug Nodes=localhost Default=YES\n")
    return conf


@pytest.mark.skipif(not all(shutil.which(c) for c in SLURM_COMMANDS), reason="no Slurm client (sbatch, srun) here")
def test_a_dead_slurm_controller_is_one_line_exit_2_and_leaves_nothing_behind(tmp_path):
    with socket.socket() as held:  # bound, never listening: every connection to it is refused
        held.bind(("127.0.0.1", 0))
        conf = _dead_controller_conf(tmp_path, shutil.which("sbatch"), held.getsockname()[1])
        fresh, earlier = tmp_path / "new" / "run", tmp_path / "earlier"
        earlier.mkdir()
        (earlier / "notes.txt").write_text("kept")
        for run_dir in (fresh, earlier):
            r = hpcnft("submit", "tiny", "--cluster", "slurm", "--run-dir", str(run_dir), check=False,
                       env={"SLURM_CONF": str(conf)})
            assert "sbatch failed, nothing was submitted: " in _one_line_refusal(r)
    assert sorted(os.listdir(tmp_path)) == ["earlier", "slurm.conf"]
    assert os.listdir(earlier) == ["notes.txt"]  # an existing run dir keeps what it held, and only that


def test_dry_run_prints_the_sbatch_script_and_creates_nothing(tmp_path):
    run_dir = tmp_path / "run"
    r = hpcnft("submit", "tiny", "--cluster", "slurm", "--run-dir", str(run_dir), "--dry-run", "--steps", "5",
               "--partition", "gpu", "--account", "lab", "--gpus-per-node", "3", "--mem-gb", "64", "--time", "90",
               env={"PATH": _without_slurm()})  # a login node's preview needs no Slurm
    lines = r.stdout.splitlines()
    assert lines[0] == "#!/bin/bash"
    for flag in ("--partition=gpu", "--account=lab", "--gpus-per-node=3", "--mem=64GB", "--time=90",
                 "--nodes=1", "--ntasks-per-node=3", "--signal=USR2@120", f"--output={run_dir}/submitit/%j_0_log.out"):
        assert f"#SBATCH {flag}" in lines, (flag, r.stdout)
    # the job's interpreter runs without the working directory on its import path
    assert any(line.startswith("srun ") and line.endswith(f" -P -u -m submitit.core._submit {run_dir}/submitit")
               for line in lines), r.stdout
    assert r.stderr == ("hpcnft submit: dry run, nothing created or submitted; its tasks are the ranks of "
                        f"hpcnft run tiny --run-dir {run_dir} --steps 5\n")
    assert os.listdir(tmp_path) == []


def test_dry_run_of_a_local_job_prints_submitits_parameters(tmp_path):
    r = hpcnft("submit", "tiny", "--cluster", "local", "--run-dir", str(tmp_path / "run"), "--dry-run",
               "--mem-gb", "1.5")
    assert r.stdout.splitlines() == [
        "cluster = 'local'", f"folder = '{tmp_path}/run/submitit'", "cpus_per_task = 1", "mem_gb = 1.5",
        "name = 'hpcnft'", "nodes = 1", "tasks_per_node = 3", "timeout_min = 60"]
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not all(shutil.which(c) for c in SLURM_COMMANDS), reason="no Slurm client (sbatch, srun) here")
def test_the_dry_runs_script_is_the_one_submitit_submits(tmp_path):
    import submitit

    from hpcnft.run.submit import prepare

    planned = prepare("tiny", "slurm", run_dir=str(tmp_path / "run"), nodes=3, tasks_per_node=1, gpus_per_node=4,
                      cpus_per_task=2, timeout_min=90, partition="p", account="a", mem_gb=12.5)
    from hpcnft.run.submit import safe_python

    executor = submitit.AutoExecutor(folder=planned.folder, cluster="slurm", slurm_python=safe_python())
    executor.update_parameters(**planned.params)
    real = executor._executor._make_submission_file_text(executor._executor._submitit_command_str, "")
    assert planned.preview() == real
    assert "#SBATCH --mem=12800MB" in real.splitlines()


def test_a_node_range_is_submitted_as_one_when_every_count_in_it_fits_the_layout(tmp_path):
    from hpcnft.run.submit import node_counts, prepare

    assert list(node_counts("2-4")) == [2, 3, 4] and list(node_counts(3)) == [3]
    for bad in ("0", "3-2", "two", "1-", "-2"):
        with pytest.raises(UsageError, match="--nodes: expected a node count N or a range MIN-MAX"):
            node_counts(bad)
    invariant = ["determinism.layout_invariant=true", "determinism.virtual_shards=4"]
    sub = prepare("tiny", "slurm", invariant, str(tmp_path / "a"), nodes="2-3", tasks_per_node=1)
    assert "#SBATCH --nodes=2-3" in sub.preview().splitlines()
    # on 4 nodes: 3 train ranks, which neither the 16 samples nor the 4 shards split over
    with pytest.raises(UsageError, match="--nodes 2-4: on 4 nodes, rollout: 16 samples per step do not split"):
        prepare("tiny", "slurm", invariant, str(tmp_path / "b"), nodes="2-4", tasks_per_node=1)
    assert os.listdir(tmp_path) == []
