"""hpcnft.run.submit.submit: a run dir in use is refused at submission, naming its holder,
before any job is queued."""
from __future__ import annotations

import os

import pytest

from hpcnft.io.rundir_lock import RunDirInUse, acquire
from hpcnft.run.submit import submit


def test_a_run_dir_in_use_is_refused_before_anything_is_submitted(tmp_path):
    run_dir = str(tmp_path / "run")
    held = acquire(run_dir, pytest.fail)
    try:
        with pytest.raises(RunDirInUse, match=f"^run dir {run_dir} is in use by pid {os.getpid()} "):
            submit("tiny", cluster="debug", run_dir=run_dir, steps=1)
    finally:
        held.release()
    assert sorted(os.listdir(run_dir)) == [".lock"]  # no submitit folder: nothing was queued
