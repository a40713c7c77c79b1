"""What a run tells the user on the terminal: the models loading with their time, the resume
point, each checkpoint skipped and why, a closing summary, and that a finished run has nothing
left to do."""
from __future__ import annotations

import os
import re

import pytest

from jobs import hpcnft

pytestmark = pytest.mark.slow


def test_loading_resume_skipped_checkpoints_summary_and_an_already_finished_run(tmp_path):
    run_dir = str(tmp_path / "run")
    every = ["--set", "checkpoint.every=1", "--set", "checkpoint.keep=3"]
    first = hpcnft("run", "tiny", "--steps", "2", "--run-dir", run_dir, *every)
    lines = first.stdout.splitlines()
    assert "hpcnft: loading the models" in lines
    assert any(re.fullmatch(r"hpcnft: models loaded in \d+\.\d s", line) for line in lines), first.stdout
    where = re.escape(run_dir)
    assert re.fullmatch(rf"hpcnft: finished 2 steps \(2 in this start, \d\d:\d\d:\d\d\); run file {where}/run\.h5; "
                        rf"last checkpoint {where}/checkpoints/step_000002", lines[-1]), first.stdout
    assert lines.index("hpcnft: loading the models") < lines.index([x for x in lines if x.startswith("step 1/2")][0])

    os.remove(os.path.join(run_dir, "checkpoints", "step_000002", "COMPLETE"))  # never committed
    second = hpcnft("run", "tiny", "--steps", "3", "--run-dir", run_dir, *every)
    assert "skipping checkpoint" in second.stderr and "no COMPLETE marker" in second.stderr, second.stderr
    assert (f"hpcnft: resuming after step 1 from checkpoint {run_dir}/checkpoints/step_000001"
            in second.stdout.splitlines()), second.stdout
    assert "step 2/3" in second.stdout and "hpcnft: finished 3 steps (2 in this start" in second.stdout

    third = hpcnft("run", "tiny", "--steps", "3", "--run-dir", run_dir, *every)
    assert (f"hpcnft: {run_dir} already finished at step 3; nothing to run (--steps N with N > 3 continues it)"
            in third.stdout.splitlines()), third.stdout
    assert not [line for line in third.stdout.splitlines() if line.startswith("step ")], third.stdout
    assert "finished 3 steps (" not in third.stdout
