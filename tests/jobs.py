"""Helpers for end-to-end runs of the tiny job as real processes (gloo on CPU)."""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import h5py
import numpy as np
import psutil

from hpcnft.io.compare import compare_metrics
from hpcnft.io.runfile import read_run


def hpcnft(*args: str, timeout: float = 600, check: bool = True, env: dict | None = None):
    r = subprocess.run([sys.executable, "-m", "hpcnft", *args], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    if check and r.returncode != 0:
        raise AssertionError(f"hpcnft {' '.join(args)} exited {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def start(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hpcnft", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


def wait_for_line(proc: subprocess.Popen, needle: str, timeout: float = 300) -> list[str]:
    """Read the job's stdout until a line contains `needle`."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if needle in line:
            return seen
    ended = proc.poll()
    err = proc.stderr.read()[-3000:] if ended is not None and proc.stderr else ""
    raise AssertionError(f"never saw {needle!r}; got {seen}" + (f"; exit {ended}, stderr:\n{err}" if err else ""))


def wait_for_attempts(run_dir: str, n: int, proc, timeout: float = 120) -> None:
    """Until run.h5 records its n-th attempt (rank 0 has opened it and is into the step). A read
    that meets the writer's brief non-SWMR reopen (where an attempt is added) finds nothing yet."""
    from hpcnft.io.runfile import RunFileError

    deadline = time.monotonic() + timeout
    while True:
        try:
            if len(read_run(run_dir).attempts) >= n:
                return
        except RunFileError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, rank_logs(run_dir)
        time.sleep(0.05)


def rank_pids(spawner_pid: int) -> dict[int, int]:
    """{rank: pid} of the ranks a local spawner started (each names itself hpcnft-rank-N)."""
    out = {}
    for child in psutil.Process(spawner_pid).children():
        try:
            name = child.name()
        except psutil.NoSuchProcess:
            continue
        if name.startswith("hpcnft-rank-"):
            out[int(name.rsplit("-", 1)[1])] = child.pid
    return out


def kill_all_ranks(proc: subprocess.Popen, sig=signal.SIGKILL) -> None:
    pids = rank_pids(proc.pid)
    for pid in pids.values():
        os.kill(pid, sig)
    proc.kill()
    proc.wait(timeout=60)


def preempt_during(recipe: str, steps: str, run_dir: str, step: int, extra=()) -> int:
    """Start `hpcnft run recipe --steps steps`, send SIGUSR2 once step `step - 1` is printed; the
    job checkpoints at the end of the iteration in which the ranks agree on the flag (step - 1 if
    the signal beat the agreement of that step, else step) and exits 75. Returns that step."""
    proc = start("run", recipe, "--steps", steps, "--run-dir", run_dir, *extra)
    wait_for_line(proc, f"step {step - 1}/{steps}")
    sent = time.strftime("%H:%M:%S")
    proc.send_signal(signal.SIGUSR2)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, f"SIGUSR2 sent at {sent}\n{out}\n{err}\n{rank_logs(run_dir)}"
    stopped = int(re.search(r"preempted at step (\d+)", out).group(1))
    assert stopped in (step - 1, step), out
    return stopped


def sigkill_during(recipe: str, steps: str, run_dir: str, step: int, extra=()) -> None:
    """Start the job and SIGKILL every rank while `step` runs (after step-1's checkpoint)."""
    proc = start("run", recipe, "--steps", steps, "--run-dir", run_dir, *extra)
    wait_for_line(proc, f"step {step - 1}/{steps}")
    kill_all_ranks(proc)


def rank_logs(run_dir: str) -> str:
    """The ranks' logs, timestamped: when each rank saw the signal, if it did."""
    logs = os.path.join(run_dir, "logs")
    return "\n".join(f"--- {name}\n" + open(os.path.join(logs, name)).read()
                     for name in sorted(os.listdir(logs))) if os.path.isdir(logs) else "(no logs)"


def non_perf(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith("perf/") and len(v)}


def assert_same_metrics(run_a: str, run_b: str) -> None:
    """Bit-identical non-perf series, by the project's comparison and by a plain h5py read."""
    a, b = non_perf(read_run(run_a).metrics), non_perf(read_run(run_b).metrics)
    assert set(a) == set(b)
    result = compare_metrics(a, b)
    assert result.same, "\n".join(str(d) for d in result.divergences)
    with h5py.File(os.path.join(run_a, "run.h5"), "r", locking=False) as fa, \
            h5py.File(os.path.join(run_b, "run.h5"), "r", locking=False) as fb:
        for key in a:
            x, y = fa[f"metrics/{key}"][()], fb[f"metrics/{key}"][()]
            assert x.shape == y.shape, key
            assert np.array_equal(x, y, equal_nan=True), key


def assert_resumed_after_step_one_is_uninterrupted(base: Path, *args: str) -> subprocess.CompletedProcess:
    """`hpcnft run tiny ARGS` for 2 steps, and for 1 step then resumed to 2 in another run dir:
    the same bits. Returns the uninterrupted run's process (its output)."""
    whole, resumed = str(base / "whole"), str(base / "resumed")
    done = hpcnft("run", "tiny", "--steps", "2", "--run-dir", whole, *args)
    hpcnft("run", "tiny", "--steps", "1", "--run-dir", resumed, *args)
    hpcnft("run", "tiny", "--steps", "2", "--run-dir", resumed, *args)
    assert_same_metrics(whole, resumed)
    return done


# Train metrics of different train-rank counts differ only by the order in which gradients and
# metric sums are reduced; over one step that is far below this tolerance (docs/determinism.md).
TRAIN_RTOL = 1e-5


def assert_step_one_agrees(ref_run: str, run: str, rollout_rtol: float = 0.0) -> None:
    """Step 1 of one config on two layouts: the rollout metrics bit-identical (the same images and
    scores, whoever made them), or within `rollout_rtol` when a lever may round the rollout
    otherwise; the training metrics within TRAIN_RTOL."""
    ref, got = non_perf(read_run(ref_run).metrics), non_perf(read_run(run).metrics)
    rollout = [k for k in got if k.startswith("rollout/reward/")]
    train = [k for k in got if k.startswith("train/")]
    assert rollout and train and set(rollout + train) <= set(ref)
    for key in rollout:
        if rollout_rtol:
            assert np.allclose(got[key][0, 1], ref[key][0, 1], rtol=rollout_rtol, atol=1e-9), key
        else:
            assert got[key][0, 1] == ref[key][0, 1], key
    for key in train:
        assert np.allclose(got[key][0, 1], ref[key][0, 1], rtol=TRAIN_RTOL, atol=1e-12, equal_nan=True), key


# -- the session's shared tiny run (tests/conftest.py: tiny_run, tiny_run_again) ------------
# `hpcnft run tiny --steps 3` with a checkpoint after every step (all three kept): the standard
# it must match is of this command (checkpoints change no metric), resume and rebuild tests start
# from copies of it cut back to an earlier checkpoint, export reads its checkpoints, and the
# launcher tests compare their runs with it. Tests read it and never write into it; a test that
# changes a run works on `copy_run`'s copy.
TINY_STEPS = 3
TINY_ARGS = ("--set", "checkpoint.every=1", "--set", f"checkpoint.keep={TINY_STEPS}")


# determinism.layout_invariant, a checkpoint every step: the session's `invariant_run` (conftest)
INVARIANT_ARGS = ("--set", "determinism.layout_invariant=true", "--set", "checkpoint.every=1")
INVARIANT_STEPS = 4


class FinishedRun(NamedTuple):
    run_dir: str
    stdout: str
    stderr: str
    seconds: float


def start_tiny_run(run_dir: str, steps: int = TINY_STEPS, args: tuple[str, ...] = TINY_ARGS) -> FinishedRun:
    """Through the local spawner, even when pytest itself runs inside a Slurm allocation."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "hpcnft", "run", "tiny", "--steps", str(steps), "--run-dir",
                        run_dir, *args], capture_output=True, text=True, timeout=600, env=env)
    if r.returncode != 0:
        raise AssertionError(f"the shared tiny run exited {r.returncode}\n{r.stdout}\n{r.stderr}")
    return FinishedRun(run_dir, r.stdout, r.stderr, time.monotonic() - t0)


def copy_run(run: FinishedRun | str, to: str, keep_checkpoints_through: int | None = None) -> str:
    """A copy of a finished run dir to change; with `keep_checkpoints_through`, its later
    checkpoints are gone (the run dir of a run killed after that checkpoint, its run.h5 holding
    the later rows, which the next start drops)."""
    src = run.run_dir if isinstance(run, FinishedRun) else run
    shutil.copytree(src, to, symlinks=True)
    if keep_checkpoints_through is not None:
        ckpts = os.path.join(to, "checkpoints")
        for name in os.listdir(ckpts):
            if name.startswith("step_") and int(name[5:]) > keep_checkpoints_through:
                shutil.rmtree(os.path.join(ckpts, name))
    return to


# -- results made once per session, whichever xdist worker asks first ------------------------
def session_root(tmp_path_factory) -> Path:
    """The session's temporary root, the same for every xdist worker."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared_result(tmp_path_factory, name: str, make):
    """`make(folder)` run once per session whichever worker asks first, the others waiting for it
    and getting its result (JSON) and folder."""
    root = session_root(tmp_path_factory)
    folder, done = root / name, root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            folder.mkdir(exist_ok=True)
            done.write_text(json.dumps(make(folder)))
    return json.loads(done.read_text())
