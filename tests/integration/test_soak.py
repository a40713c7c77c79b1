"""Soak: a long tiny run (evaluations, sample grids and checkpoints at the tiny recipe's pace) keeps
every rank's resident memory and the step time flat. Minutes, so it runs only with HPCNFT_SOAK=1;
HPCNFT_SOAK_STEPS sets the length (default 300)."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import psutil
import pytest

from jobs import rank_pids, start
from hpcnft.io.runfile import read_run

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("HPCNFT_SOAK") != "1", reason="soak test: set HPCNFT_SOAK=1")]

STEPS = int(os.environ.get("HPCNFT_SOAK_STEPS", "300"))
SAMPLE_EVERY_S = 0.5
# A rank's memory may move by allocator noise and by what each checkpoint or grid leaves cached,
# not by a trend: the last quarter of the run against the second (the first is warm-up).
RSS_GROWTH_MAX = 32 * 2**20  # bytes, or 3 % of the rank's RSS if that is more
STEP_TIME_GROWTH_MAX = 1.5  # median iteration time, last quarter over the second (a shared machine)


def follow(proc, state: dict) -> None:
    """Keep state["step"] at the last `step k/N` line the job printed."""
    for line in proc.stdout:
        if line.startswith("step "):
            state["step"] = int(line.split()[1].split("/")[0])


def keep_stderr(proc, state: dict) -> None:
    """Read the job's stderr as it comes (a full pipe would stall the job)."""
    state["stderr"] = proc.stderr.read()


def sample_rss(proc, state: dict) -> list[tuple[int, int, int]]:
    """(step, rank, RSS bytes) of every rank twice a second from step 1 until the job ends."""
    samples, ranks = [], {}
    while proc.poll() is None:
        step = state["step"]
        if step and not ranks:
            ranks = {rank: psutil.Process(pid) for rank, pid in rank_pids(proc.pid).items()}
        for rank, process in ranks.items():
            try:
                samples.append((step, rank, process.memory_info().rss))
            except psutil.NoSuchProcess:  # the job is ending
                pass
        time.sleep(SAMPLE_EVERY_S)
    return samples


def quarter(steps: np.ndarray, which: int) -> np.ndarray:
    return (steps > STEPS * which / 4) & (steps <= STEPS * (which + 1) / 4)


def test_memory_and_step_time_stay_flat_over_a_long_run(tmp_path):
    run_dir = str(tmp_path / "soak")
    proc = start("run", "tiny", "--steps", str(STEPS), "--run-dir", run_dir)
    state = {"step": 0, "stderr": ""}
    readers = [threading.Thread(target=f, args=(proc, state), daemon=True) for f in (follow, keep_stderr)]
    for reader in readers:
        reader.start()
    try:
        samples = np.array(sample_rss(proc, state), dtype=np.int64)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)
    for reader in readers:
        reader.join(timeout=10)
    assert proc.returncode == 0, state["stderr"][-3000:]
    assert len(np.unique(samples[:, 1])) == 3  # every rank of the 2 + 1 job

    report = []
    for rank in np.unique(samples[:, 1]):
        mine = samples[samples[:, 1] == rank]
        second, last = (np.median(mine[quarter(mine[:, 0], q), 2]) for q in (1, 3))
        report.append(f"rank {rank}: RSS {second / 2**20:.1f} -> {last / 2**20:.1f} MiB")
        assert last - second <= max(RSS_GROWTH_MAX, 0.03 * second), report
    iteration = read_run(run_dir).metrics["perf/iteration_s"]
    second, last = (np.median(iteration[quarter(iteration[:, 0], q), 1]) for q in (1, 3))
    report.append(f"iteration {second:.3f} -> {last:.3f} s")
    assert last <= STEP_TIME_GROWTH_MAX * second, report
    print("; ".join(report))
