"""A dead rank ends the whole job, naming the rank; nothing written is lost."""
from __future__ import annotations

import os
import signal

import pytest

from jobs import rank_pids, start, wait_for_line
from hpcnft.io.runfile import read_run

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("victim,role", [(2, "reward"), (1, "train")])
def test_killing_a_rank_ends_the_job_naming_it(tmp_path, victim, role):
    run_dir = str(tmp_path / f"kill-{victim}")
    proc = start("run", "tiny", "--steps", "20", "--run-dir", run_dir)
    wait_for_line(proc, "step 2/20")
    rows_before = read_run(run_dir).metrics["train/nft_loss"].shape[0]
    os.kill(rank_pids(proc.pid)[victim], signal.SIGKILL)
    out, err = proc.communicate(timeout=120)  # a job that outlives its dead rank is a hang
    assert proc.returncode != 0
    assert f"rank {victim} ({role}) failed: killed by SIGKILL" in err
    run = read_run(run_dir)  # readable, and every row written before the fault is still there
    assert run.metrics["train/nft_loss"].shape[0] >= rows_before
    assert run.metrics["train/nft_loss"][:, 0].tolist()[:2] == [1.0, 2.0]
