"""Bit-exact resume: every interrupted variant ends with the uninterrupted run's metrics."""
from __future__ import annotations

import os
import shutil

import pytest

import jobs
from jobs import assert_same_metrics, hpcnft
from hpcnft.io.runfile import read_run

pytestmark = pytest.mark.slow

STEPS = "6"
EVERY_STEP = ["--set", "checkpoint.every=1"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("resume") / "full")
    hpcnft("run", "tiny", "--steps", STEPS, "--run-dir", run_dir)
    return run_dir


def preempt_during(run_dir: str, step: int, extra=()) -> int:
    return jobs.preempt_during("tiny", STEPS, run_dir, step, extra)


def sigkill_during(run_dir: str, step: int, extra=()) -> None:
    jobs.sigkill_during("tiny", STEPS, run_dir, step, extra)


def test_a_shorter_run_then_more_steps(uninterrupted, tmp_path):
    run_dir = str(tmp_path / "a")
    hpcnft("run", "tiny", "--steps", "2", "--run-dir", run_dir)
    hpcnft("run", "tiny", "--steps", STEPS, "--run-dir", run_dir)
    assert_same_metrics(uninterrupted, run_dir)


def test_b_preemption_signal_then_rerun(uninterrupted, tmp_path):
    run_dir = str(tmp_path / "b")
    stopped = preempt_during(run_dir, 3)
    hpcnft("run", "tiny", "--steps", STEPS, "--run-dir", run_dir)
    assert_same_metrics(uninterrupted, run_dir)
    run = read_run(run_dir)
    kinds = [e["kind"] for e in run.events]
    assert "signal" in kinds and "resume" in kinds
    assert [a["from_step"] for a in run.attempts] == [0, stopped]
    shown = hpcnft("show", run_dir).stdout
    assert "attempts (2)" in shown and "signal" in shown and "resume" in shown


def test_c_sigkill_of_every_rank_then_rerun(uninterrupted, tmp_path):
    run_dir = str(tmp_path / "c")
    sigkill_during(run_dir, 5, EVERY_STEP)
    assert read_run(run_dir).metrics["train/nft_loss"].shape[0] >= 4  # rows before the fault survive
    hpcnft("run", "tiny", "--steps", STEPS, "--run-dir", run_dir, *EVERY_STEP)
    assert_same_metrics(uninterrupted, run_dir)


def test_d_two_interruptions(uninterrupted, tmp_path):
    run_dir = str(tmp_path / "d")
    preempt_during(run_dir, 2, EVERY_STEP)
    sigkill_during(run_dir, 5, EVERY_STEP)
    hpcnft("run", "tiny", "--steps", STEPS, "--run-dir", run_dir, *EVERY_STEP)
    assert_same_metrics(uninterrupted, run_dir)
    assert len(read_run(run_dir).attempts) == 3


def test_incomplete_checkpoints_are_never_loaded(uninterrupted, tmp_path):
    run_dir = str(tmp_path / "e")
    hpcnft("run", "tiny", "--steps", "3", "--run-dir", run_dir, *EVERY_STEP, "--set", "checkpoint.keep=3")
    ckpts = os.path.join(run_dir, "checkpoints")
    os.remove(os.path.join(ckpts, "step_000003", "COMPLETE"))  # never committed
    shard = next(f for f in os.listdir(os.path.join(ckpts, "step_000002")) if f.endswith(".distcp"))
    os.remove(os.path.join(ckpts, "step_000002", shard))  # a shard lost
    r = hpcnft("run", "tiny", "--steps", STEPS, "--run-dir", run_dir, *EVERY_STEP)
    assert "step 2/6" in r.stdout and "step 1/6" not in r.stdout  # resumed from step 1
    assert_same_metrics(uninterrupted, run_dir)
    warnings = [e["text"] for e in read_run(run_dir).events if "skipping checkpoint" in e["text"]]
    assert any("no COMPLETE marker" in w for w in warnings) and any("is missing" in w for w in warnings)


def test_resume_with_another_learning_rate_is_refused(tmp_path):
    run_dir = str(tmp_path / "f")
    hpcnft("run", "tiny", "--steps", "1", "--run-dir", run_dir)
    before = open(os.path.join(run_dir, "run.h5"), "rb").read()
    r = hpcnft("run", "tiny", "--steps", "2", "--run-dir", run_dir, "--set", "optim.lr=0.01", check=False)
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "optim.lr" in lines[0], r.stderr
    assert open(os.path.join(run_dir, "run.h5"), "rb").read() == before
    shutil.rmtree(run_dir)
