"""Bit-exact resume: every interrupted variant ends with the uninterrupted run's metrics (the
session's `tiny_run`: `hpcnft run tiny --steps 3`), and says on the terminal where it resumed and
which checkpoints it skipped."""
from __future__ import annotations

import os
import signal

import pytest

from jobs import (TINY_ARGS, assert_same_metrics, copy_run, hpcnft, kill_all_ranks, start, wait_for_attempts,
                  wait_for_line)
from hpcnft.io.runfile import read_run

pytestmark = pytest.mark.slow

STEPS = "3"


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> dict:
    """One run dir through every kind of stop, each start resuming from the one before:
      1. `--steps 1`: a shorter run, finished;
      2. `--steps 3`: preempted (SIGUSR2) as it resumes, so it checkpoints after step 2, exit 75;
      3. `--steps 3`: every rank SIGKILLed while step 3 runs (checkpoint 2 is the last one);
      4. `--steps 3`: to the end.
    Returns the run dir, each start's output and what was seen between them."""
    run_dir = str(tmp_path_factory.mktemp("interrupted") / "run")
    seen = {"run_dir": run_dir}
    seen["first"] = hpcnft("run", "tiny", "--steps", "1", "--run-dir", run_dir)

    proc = start("run", "tiny", "--steps", STEPS, "--run-dir", run_dir)
    before = wait_for_line(proc, "hpcnft: resuming after step 1")
    proc.send_signal(signal.SIGUSR2)
    out, err = proc.communicate(timeout=300)
    seen["preempted"] = (proc.returncode, "".join(before) + out, err)

    proc = start("run", "tiny", "--steps", STEPS, "--run-dir", run_dir)
    wait_for_line(proc, "hpcnft: resuming after step 2")
    wait_for_attempts(run_dir, 3, proc)
    kill_all_ranks(proc)
    seen["rows_after_kill"] = read_run(run_dir).metrics["train/nft_loss"][:, 0].tolist()

    seen["last"] = hpcnft("run", "tiny", "--steps", STEPS, "--run-dir", run_dir)
    return seen


def test_every_interrupted_start_resumes_and_the_run_ends_with_the_uninterrupted_bits(interrupted, tiny_run):
    run_dir = interrupted["run_dir"]
    assert_same_metrics(tiny_run.run_dir, run_dir)
    assert [a["from_step"] for a in read_run(run_dir).attempts] == [0, 1, 2, 2]


def test_a_shorter_run_then_more_steps(interrupted):
    assert "hpcnft: finished 1 step (1 in this start" in interrupted["first"].stdout  # a run of its own
    code, out, _ = interrupted["preempted"]
    assert "hpcnft: resuming after step 1 from checkpoint" in out and "step 2/3" in out and "step 1/3" not in out


def test_a_preemption_signal_checkpoints_and_exits_75(interrupted):
    code, out, err = interrupted["preempted"]
    assert code == 75, out + err
    assert "hpcnft: preempted at step 2" in out, out
    run = read_run(interrupted["run_dir"])
    kinds = [e["kind"] for e in run.events]
    assert "signal" in kinds and "resume" in kinds
    assert any(e["kind"] == "signal" and e["step"] == 2 and e["text"].startswith("SIGUSR2") for e in run.events)
    shown = hpcnft("show", interrupted["run_dir"]).stdout
    assert "attempts (4)" in shown and "signal" in shown and "resume" in shown


def test_sigkill_of_every_rank_loses_no_committed_row(interrupted):
    assert interrupted["rows_after_kill"][:2] == [1.0, 2.0]  # rows before the fault survive
    assert "hpcnft: resuming after step 2 from checkpoint" in interrupted["last"].stdout
    assert "hpcnft: finished 3 steps (1 in this start" in interrupted["last"].stdout


def test_incomplete_checkpoints_are_skipped_saying_why_and_never_loaded(tiny_run, tmp_path):
    run_dir = copy_run(tiny_run, str(tmp_path / "run"))
    ckpts = os.path.join(run_dir, "checkpoints")
    os.remove(os.path.join(ckpts, "step_000003", "COMPLETE"))  # never committed
    shard = next(f for f in os.listdir(os.path.join(ckpts, "step_000002")) if f.endswith(".distcp"))
    os.remove(os.path.join(ckpts, "step_000002", shard))  # a shard lost
    r = hpcnft("run", "tiny", "--steps", STEPS, "--run-dir", run_dir, *TINY_ARGS)
    skipped = [line for line in r.stderr.splitlines() if "skipping checkpoint" in line]
    assert any("step_000003" in w and "no COMPLETE marker" in w for w in skipped), r.stderr
    assert any("step_000002" in w and "is missing" in w for w in skipped), r.stderr
    assert (f"hpcnft: resuming after step 1 from checkpoint {run_dir}/checkpoints/step_000001"
            in r.stdout.splitlines()), r.stdout
    assert "step 2/3" in r.stdout and "step 1/3" not in r.stdout
    assert "hpcnft: finished 3 steps (2 in this start" in r.stdout
    assert_same_metrics(tiny_run.run_dir, run_dir)
    warnings = [e["text"] for e in read_run(run_dir).events
                if e["kind"] == "warning" and "skipping checkpoint" in e["text"]]
    assert any("no COMPLETE marker" in w for w in warnings) and any("is missing" in w for w in warnings)


def test_a_finished_run_started_again_runs_nothing(tiny_run, tmp_path):
    run_dir = copy_run(tiny_run, str(tmp_path / "run"))
    r = hpcnft("run", "tiny", "--steps", STEPS, "--run-dir", run_dir, *TINY_ARGS)
    assert (f"hpcnft: {run_dir} already finished at step 3; nothing to run (--steps N with N > 3 continues it)"
            in r.stdout.splitlines()), r.stdout
    assert not [line for line in r.stdout.splitlines() if line.startswith("step ")], r.stdout
    assert "finished 3 steps (" not in r.stdout
    # the starting process decides it from the checkpoint's files and run.h5: no rank starts
    assert " rank(s): train " not in r.stdout and "loading the models" not in r.stdout, r.stdout


def test_resume_with_another_learning_rate_is_refused(tiny_run, tmp_path):
    run_dir = copy_run(tiny_run, str(tmp_path / "run"))
    before = open(os.path.join(run_dir, "run.h5"), "rb").read()
    r = hpcnft("run", "tiny", "--steps", "4", "--run-dir", run_dir, *TINY_ARGS, "--set", "optim.lr=0.01",
               check=False)
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "optim.lr" in lines[0], r.stderr
    assert lines[0] == (f"hpcnft run: error: cannot resume {run_dir}: the config differs from its checkpoint in "
                        "optim.lr (0.003 -> 0.01)")
    assert " rank(s): train " not in r.stdout, r.stdout  # refused before any rank starts
    assert open(os.path.join(run_dir, "run.h5"), "rb").read() == before


def test_a_resume_that_keeps_the_frozen_base_whole_on_every_rank_ends_with_the_same_bits(tiny_run, tmp_path):
    """perf.replicate_frozen_base changes where the base lives, not a bit: switched on by the resume
    of a run that sharded it (and so allowed to change on resume), the run ends as the shared one."""
    run_dir = copy_run(tiny_run, str(tmp_path / "replicated"), keep_checkpoints_through=1)
    out = hpcnft("run", "tiny", "--steps", STEPS, "--run-dir", run_dir, *TINY_ARGS,
                 "--set", "perf.replicate_frozen_base=true").stdout
    assert "hpcnft: resuming after step 1 from checkpoint" in out
    assert_same_metrics(tiny_run.run_dir, run_dir)
