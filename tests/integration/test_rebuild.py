"""run.h5 deleted, truncated or replaced by another run's file between two starts: the next start
rebuilds it from the checkpoint's copy, says so, keeps the damaged file aside, and ends with the
uninterrupted run's metrics and RNG snapshots, bit for bit; with no copy to rebuild from, the
start is refused in one line."""
from __future__ import annotations

import os

import pytest

from hardening_tools import writer_made_run
from jobs import TINY_ARGS, assert_same_metrics, copy_run, hpcnft
from hpcnft.io import run_state
from hpcnft.io.runfile import read_rng, read_run

pytestmark = pytest.mark.slow

STEPS = "3"


def cut_back_to_step_2(tiny_run, to: str) -> str:
    """The run dir of a run killed after step 2's checkpoint: a copy of the session's tiny run
    (3 steps, a checkpoint after each) without step 3's checkpoint."""
    return copy_run(tiny_run, to, keep_checkpoints_through=2)


def continue_run(run_dir: str, check: bool = True):
    return hpcnft("run", "tiny", "--steps", STEPS, "--run-dir", run_dir, *TINY_ARGS, check=check)


def assert_same_rng(run_a: str, run_b: str) -> None:
    a, b = read_run(run_a), read_run(run_b)
    assert a.rng_steps == b.rng_steps == [1, 2, 3]
    for step in a.rng_steps:
        states = read_rng(a.path, step)
        assert sorted(states) == [0, 1, 2] and states == read_rng(b.path, step), step


def _delete(path: str, tmp_path) -> None:
    os.remove(path)


def _truncate(path: str, tmp_path) -> None:
    data = open(path, "rb").read()
    open(path, "wb").write(data[:len(data) // 2])


def _another_runs_file(path: str, tmp_path) -> None:
    os.remove(path)
    writer_made_run(path, steps=6)  # a run file of this schema, with rows past step 2, of another run


@pytest.mark.parametrize("damage,tag", [(_delete, None), (_truncate, "damaged"), (_another_runs_file, "other-run")])
def test_a_lost_run_file_is_rebuilt_and_the_run_ends_as_the_uninterrupted_one(tiny_run, tmp_path, damage, tag):
    run_dir = cut_back_to_step_2(tiny_run, str(tmp_path / "run"))
    uninterrupted = tiny_run.run_dir
    path = os.path.join(run_dir, "run.h5")
    damage(path, tmp_path)
    damaged = open(path, "rb").read() if os.path.exists(path) else None
    r = continue_run(run_dir)
    warnings = [line for line in r.stderr.splitlines() if "rebuilt from checkpoint" in line]
    assert len(warnings) == 1 and warnings[0].startswith("hpcnft: warning: "), r.stderr
    assert os.path.join(run_dir, "checkpoints", "step_000002") in warnings[0]
    assert "step 3/3" in r.stdout and "step 2/3" not in r.stdout  # resumed after step 2
    assert_same_metrics(uninterrupted, run_dir)
    assert_same_rng(uninterrupted, run_dir)
    assert hpcnft("compare", uninterrupted, run_dir).returncode == 0
    run = read_run(run_dir)
    assert [a["from_step"] for a in run.attempts] == [0, 2]  # the first start's attempt came back
    run_id = read_run(uninterrupted).attrs[run_state.RUN_ID]
    assert run.attrs[run_state.RUN_ID] == run_id and f"run id {run_id})" in hpcnft("show", run_dir).stdout
    assert [e["kind"] for e in run.events].count("checkpoint") == 3
    assert any(e["kind"] == "warning" and "rebuilt from checkpoint" in e["text"] for e in run.events)
    aside = [n for n in os.listdir(run_dir) if n.startswith("run.h5.")]
    if tag is None:
        assert aside == [] and "kept as" not in warnings[0]
    else:
        assert len(aside) == 1 and aside[0].startswith(f"run.h5.{tag}-") and aside[0] in warnings[0]
        assert open(os.path.join(run_dir, aside[0]), "rb").read() == damaged  # kept as it was


def test_a_newer_checkpoint_without_a_usable_copy_is_skipped_for_the_rebuild(tiny_run, tmp_path):
    run_dir = cut_back_to_step_2(tiny_run, str(tmp_path / "run"))
    os.remove(os.path.join(run_dir, "run.h5"))
    newest = os.path.join(run_dir, "checkpoints", "step_000002")
    with open(run_state.run_state_path(newest), "r+b") as f:
        f.truncate(100)
    r = continue_run(run_dir)
    assert f"skipping checkpoint {newest} for rebuilding run.h5: run_state.h5" in r.stderr
    assert "step 2/3" in r.stdout and "step 1/3" not in r.stdout  # resumed after step 1
    assert_same_metrics(tiny_run.run_dir, run_dir)
    assert_same_rng(tiny_run.run_dir, run_dir)


def test_without_a_copy_in_any_checkpoint_the_start_is_refused_in_one_line(tiny_run, tmp_path):
    run_dir = cut_back_to_step_2(tiny_run, str(tmp_path / "run"))
    os.remove(os.path.join(run_dir, "run.h5"))
    ckpts = os.path.join(run_dir, "checkpoints")
    for name in os.listdir(ckpts):  # checkpoints as an earlier version wrote them
        os.remove(run_state.run_state_path(os.path.join(ckpts, name)))
    before = sorted(os.listdir(run_dir))
    r = continue_run(run_dir, check=False)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "run.h5 is missing" in lines[0] and "no checkpoint holds a copy" in lines[0]
    assert "restore run.h5" in lines[0] and "another --run-dir" in lines[0]
    assert sorted(os.listdir(run_dir)) == before
