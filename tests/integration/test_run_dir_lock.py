"""One owner per run dir, with real processes and real flock: a second `hpcnft run` on a run dir
in use exits 2 at once with one line naming the holder, whether it starts together with the
first or while the first runs, through the local spawner or as a launcher's ranks; the first
run goes on undisturbed. A lock left by a killed owner is taken over with a warning."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from jobs import hpcnft, start, wait_for_line
from hpcnft.distributed.spawner import free_port
from hpcnft.io.rundir_lock import Holder, parse_holder
from hpcnft.io.runfile import read_run

pytestmark = pytest.mark.slow

HOST = socket.gethostname()


def refusal_prefix(run_dir: str, pid: int) -> str:
    job = f" (Slurm job {os.environ['SLURM_JOB_ID']})" if os.environ.get("SLURM_JOB_ID") else ""
    return f"hpcnft: run dir {run_dir} is in use by pid {pid} on host {HOST}{job} since "


def assert_refused(stderr: str, run_dir: str, holder_pid: int) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith(refusal_prefix(run_dir, holder_pid)), stderr
    assert lines[0].endswith("; wait for it to end or choose another --run-dir"), stderr


def steps_written(run_dir: str) -> list[float]:
    return read_run(run_dir).metrics["train/nft_loss"][:, 0].tolist()


def test_two_starts_together_one_runs_and_the_other_is_refused(tmp_path):
    run_dir = str(tmp_path / "run")
    procs = [start("run", "tiny", "--steps", "2", "--run-dir", run_dir, "--set", "eval.at_end=false")
             for _ in range(2)]
    t0 = time.monotonic()
    while all(p.poll() is None for p in procs):
        assert time.monotonic() - t0 < 300, "neither start ended (a hang)"
        time.sleep(0.05)
    loser = next(p for p in procs if p.poll() is not None)
    winner = next(p for p in procs if p is not loser)
    assert winner.poll() is None, "the refused start must end while the other runs"
    _, err = loser.communicate()
    assert loser.returncode == 2, err
    assert_refused(err, run_dir, winner.pid)
    out, err = winner.communicate(timeout=300)
    assert winner.returncode == 0, out + err
    assert steps_written(run_dir) == [1.0, 2.0]
    assert open(os.path.join(run_dir, ".lock")).read() == ""  # released on its clean exit


def launcher_ranks(*args: str, world: int = 3) -> list[subprocess.Popen]:
    """The ranks of a job as a launcher starts them (torchrun's variables, no spawner)."""
    port = str(free_port())
    return [start(*args, env={"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
                              "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
            for r in range(world)]


def test_a_start_while_the_first_run_is_at_step_2_is_refused_and_the_first_finishes(tmp_path):
    run_dir = str(tmp_path / "run")
    args = ("run", "tiny", "--steps", "8", "--run-dir", run_dir, "--set", "checkpoint.every=1")
    first = start(*args)
    wait_for_line(first, "step 1/8")  # step 1's checkpoint is there to resume from; step 2 runs
    assert parse_holder(open(os.path.join(run_dir, ".lock")).read()).pid == first.pid

    ranks = launcher_ranks(*args)  # rank 0 takes the lock, and every rank learns it was refused
    results = [p.communicate(timeout=120) for p in ranks]
    assert [p.returncode for p in ranks] == [2, 2, 2], results
    assert_refused(results[0][1], run_dir, first.pid)
    assert not any("in use" in err for _, err in results[1:])  # one line for the job, from rank 0

    again = hpcnft(*args, check=False)  # through the local spawner: refused before any rank starts
    assert again.returncode == 2 and again.stdout == "", again.stdout + again.stderr
    assert_refused(again.stderr, run_dir, first.pid)
    assert first.poll() is None, "the refusals must come while the first run is still running"

    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, out + err
    assert steps_written(run_dir) == [float(s) for s in range(1, 9)]
    assert [a["from_step"] for a in read_run(run_dir).attempts] == [0]  # nobody else started in it


def test_the_lock_of_a_dead_owner_is_taken_over_with_a_warning(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    former = Holder(int(dead.stdout), HOST, "77", "2026-12-03T20:00:00Z")
    (run_dir / ".lock").write_text(former.to_text())
    r = hpcnft("run", "tiny", "--steps", "1", "--run-dir", str(run_dir), "--set", "eval.at_end=false")
    warning = (f"hpcnft: warning: run dir {run_dir} was held by pid {former.pid} on host {HOST} (Slurm job 77) "
               "since 2026-12-03T20:00:00Z, which is gone; taking it over")
    assert warning in r.stderr.splitlines(), r.stderr
    assert steps_written(str(run_dir)) == [1.0]
    assert (run_dir / ".lock").read_text() == ""
