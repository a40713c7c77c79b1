"""hpcnft.run.resume.plan_resume and the preflight: run.h5 is kept when it carries on from the
newest checkpoint, rebuilt when it is missing, damaged, another run's or ends before the
checkpoint (from the newest checkpoint whose copy is usable), and the start is refused in one
line when no checkpoint holds a copy."""
from __future__ import annotations

import os

import pytest

from hardening_tools import run_with_checkpoints, writer_made_run
from hpcnft.algo.nft.spec import TRAIN_KEYS as NFT_KEYS
from hpcnft.algo.root_config import load_config
from hpcnft.common.errors import UsageError
from hpcnft.io import run_state
from hpcnft.io.run_writer import RunFileWriter
from hpcnft.run.resume import RunFileLostError, plan_resume
from hpcnft.run.rundir import check_existing_run

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]  # DCP in one process


@pytest.fixture
def run(tmp_path):
    """(cfg, {step: checkpoint}) of a run dir with checkpoints 1 and 2, each with its copy of
    run.h5 as the job writes it."""
    cfg = load_config("tiny", steps=4)
    cfg.run_dir = str(tmp_path / "run")
    return cfg, run_with_checkpoints(cfg)


def _plan(cfg):
    warnings = []
    return plan_resume(cfg, cfg.run_dir, warnings.append), warnings


def test_a_run_file_that_carries_on_is_kept(run):
    cfg, ckpts = run
    plan, warnings = _plan(cfg)
    assert plan.checkpoint == (2, ckpts[2]) and plan.rebuild_why == "" and warnings == []
    check_existing_run(cfg)


def _truncate(path):
    data = open(path, "rb").read()
    open(path, "wb").write(data[:len(data) // 3])


def _rows_to_step_1(path):
    w = RunFileWriter(path, "{}", "test", NFT_KEYS)
    w.truncate_after(1)
    w.close()


@pytest.mark.parametrize("damage,why,tag", [
    (os.remove, "is missing", ""),
    (_truncate, "is damaged (", "damaged"),
    (lambda p: (os.remove(p), writer_made_run(p)), "belongs to another run (run id ", "other-run"),
    (_rows_to_step_1, "ends at step 1, before the checkpoint of step 2", "stale")])
def test_an_unusable_run_file_is_rebuilt_from_the_newest_checkpoint(run, damage, why, tag):
    cfg, ckpts = run
    damage(os.path.join(cfg.run_dir, "run.h5"))
    plan, warnings = _plan(cfg)
    assert plan.checkpoint == (2, ckpts[2]) and plan.rebuild_why.startswith(why) and plan.aside_tag == tag
    assert warnings == []
    check_existing_run(cfg)  # the preflight lets the job rebuild it


def test_a_newer_checkpoint_whose_copy_is_unusable_gives_way_to_an_older_one(run):
    cfg, ckpts = run
    os.remove(os.path.join(cfg.run_dir, "run.h5"))
    _truncate(run_state.run_state_path(ckpts[2]))
    plan, warnings = _plan(cfg)
    assert plan.checkpoint == (1, ckpts[1]) and plan.rebuild_why == "is missing"
    assert len(warnings) == 1 and warnings[0].startswith(f"skipping checkpoint {ckpts[2]} for rebuilding run.h5: ")


def test_a_usable_run_file_needs_no_copy(run):
    cfg, ckpts = run
    for path in ckpts.values():  # checkpoints of a version before the copies
        os.remove(run_state.run_state_path(path))
    plan, _ = _plan(cfg)
    assert plan.checkpoint == (2, ckpts[2]) and plan.rebuild_why == ""


def test_without_any_copy_a_lost_run_file_is_refused_in_one_line(run):
    cfg, ckpts = run
    for path in ckpts.values():
        os.remove(run_state.run_state_path(path))
    os.remove(os.path.join(cfg.run_dir, "run.h5"))
    with pytest.raises(RunFileLostError) as e:
        _plan(cfg)
    assert "run.h5 is missing" in str(e.value) and "(run_state.h5 is missing)" in str(e.value)
    assert len(str(e.value).splitlines()) == 1 and "restore run.h5" in str(e.value)
    # the spawner reads no checkpoint (that takes torch): rank 0's plan refuses it, in one line
    # (tests/integration/test_rebuild.py runs it)
    check_existing_run(cfg)  # no refusal here


def test_a_damaged_run_file_without_checkpoints_is_set_aside_and_the_run_starts_over(tmp_path):
    # a write that failed halfway (a quota, say) before the first checkpoint: nothing to rebuild
    # run.h5 from, and nothing lost by starting over; the damaged file is kept beside it
    from hpcnft.io.checkpointer import Checkpointer, Schedule
    from hpcnft.io.runfile import read_run

    cfg = load_config("tiny", steps=4)
    cfg.run_dir = str(tmp_path / "run")
    os.makedirs(cfg.run_dir)
    path = os.path.join(cfg.run_dir, "run.h5")
    writer_made_run(path)
    _truncate(path)
    damaged = open(path, "rb").read()
    plan = plan_resume(cfg, cfg.run_dir, lambda _t: None)
    assert plan.checkpoint is None and plan.rebuild_why.startswith("is damaged (") and plan.aside_tag == "damaged"
    check_existing_run(cfg)  # the spawner lets rank 0 set it aside
    resumed = Checkpointer(cfg.run_dir, None, 0, 3, "{}", Schedule(1, True, 2), parts={}).load(plan)
    aside = [name for name in os.listdir(cfg.run_dir) if name.startswith("run.h5.damaged-")]
    assert resumed.step == 0 and len(aside) == 1 and not os.path.exists(path)
    assert resumed.rebuilt == (f"{path} {plan.rebuild_why}: kept as {os.path.join(cfg.run_dir, aside[0])}; no "
                               "checkpoint to resume from, the run starts over")
    assert open(os.path.join(cfg.run_dir, aside[0]), "rb").read() == damaged
    RunFileWriter(path, "{}", "test", NFT_KEYS).close()
    assert read_run(path).metrics["train/nft_loss"].shape == (0, 2)


def test_another_configs_run_file_without_checkpoints_is_still_refused(tmp_path):
    cfg = load_config("tiny", steps=4)
    cfg.run_dir = str(tmp_path / "run")
    os.makedirs(cfg.run_dir)
    RunFileWriter(os.path.join(cfg.run_dir, "run.h5"), load_config("tiny", ["train.seed=7"]).to_json(), "x",
                  NFT_KEYS).close()
    with pytest.raises(UsageError, match="holds a run with another config"):
        check_existing_run(cfg)


def test_rank_0s_plan_carries_the_skipped_checkpoints_and_its_failures_are_raised(run, monkeypatch):
    from hpcnft.run import resume

    cfg, ckpts = run
    os.remove(os.path.join(ckpts[2], "COMPLETE"))
    plan = resume.agree_plan(cfg, 0)
    assert plan.checkpoint == (1, ckpts[1])
    assert plan.warnings == [f"skipping checkpoint {ckpts[2]}: no COMPLETE marker"]
    os.remove(os.path.join(cfg.run_dir, "run.h5"))
    os.remove(run_state.run_state_path(ckpts[1]))
    with pytest.raises(RunFileLostError, match="run.h5 is missing"):
        resume.agree_plan(cfg, 0)

    def broken(*_args):
        raise OSError("Input/output error\nwith a second line")
    monkeypatch.setattr(resume, "plan_resume", broken)
    with pytest.raises(RuntimeError, match=r"^OSError: Input/output error$"):
        resume.agree_plan(cfg, 0)


def test_a_resume_on_other_ranks_or_hosts_is_named_and_the_same_layout_is_not():
    from hpcnft.run.resume import layout_change

    before = {"train_ranks": "[0, 1]", "reward_ranks": "[2]", "hosts": '["n01", "n01", "n02"]'}  # as run.h5 holds it
    assert layout_change(before, {"train_ranks": [0, 1], "reward_ranks": [2], "hosts": ["n01", "n01", "n02"]}) == ""
    assert layout_change(before, {"train_ranks": [0, 1], "reward_ranks": [2], "hosts": ["n03", "n03", "n03"]}) == (
        "resuming on another layout: 2 train + 1 reward ranks on 2 host(s) (n01, n02) -> "
        "2 train + 1 reward ranks on 1 host(s) (n03)")
    assert layout_change(before, {"train_ranks": [0], "reward_ranks": [], "hosts": ["n01"]}).endswith(
        "-> 1 train rank(s), colocated on 1 host(s) (n01)")
    assert layout_change({}, {"train_ranks": [0], "reward_ranks": [], "hosts": ["n01"]}) == ""  # a first start
