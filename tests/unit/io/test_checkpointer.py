"""hpcnft.io.checkpointer: one Checkpointer saves and loads every part of a checkpoint (policy,
optimizer, scaler, this rank's RNG, the reward ranks' RNG, run.h5's copy, RNG rows and event);
what it saves comes back bit for bit, a failed save leaves no .partial and the last good
checkpoint as it was, and a lost run.h5 is rebuilt on rank 0 once the state is loaded."""
from __future__ import annotations

import os
import random
import types

import numpy as np
import pytest
import torch

from hardening_tools import tiny_policy
from hpcnft.algo.train_base import LossScaler
from hpcnft.common import determinism
from hpcnft.io import checkpoint, run_state, runfile
from hpcnft.algo.checkpoint_parts import checkpoint_parts
from hpcnft.io.checkpointer import Checkpointer, Resumed, Schedule, restore_rank_rng, snapshot_rank_rng
from hpcnft.io.run_writer import RunFileWriter

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]  # DCP in one process

CONFIG = '{"steps": 3}'
WORLD = 2  # rank 0 trains, rank 1 stands for a reward rank


def _reward_rank(run_dir: str, calls: list[int]):
    def peers(step: int) -> None:  # what the reward client's snapshot has the reward rank do
        calls.append(step)
        torch.rand(3)  # its RNG is not rank 0's
        snapshot_rank_rng(run_dir, step, 1)
    return peers


def _checkpointer(run_dir: str, seed: int = 0, rank: int = 0, peers=None) -> Checkpointer:
    policy, opt = tiny_policy(seed=seed)
    scaler = LossScaler(2.0 ** (seed + 4), enabled=True)
    scaler.update(found_inf=False)
    return Checkpointer(run_dir, None, rank, WORLD, CONFIG, Schedule(1, True, 2), parts=checkpoint_parts(policy, opt),
                        scaler=scaler, peers=peers)


def _run_file(run_dir: str, steps: int) -> RunFileWriter:
    os.makedirs(run_dir, exist_ok=True)
    w = RunFileWriter(os.path.join(run_dir, "run.h5"), CONFIG, "test")
    for step in range(1, steps + 1):
        w.append_metrics(step, {k: step + 0.25 for k in runfile.PER_STEP_KEYS})
    return w


def _plan(step: int, path: str, why: str = "", tag: str = ""):
    return types.SimpleNamespace(checkpoint=(step, path), rebuild_why=why, aside_tag=tag, warnings=[])


def _draws() -> tuple:
    return torch.rand(4).tolist(), random.random(), float(np.random.rand())


def _same_tensors(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_save_then_load_restores_every_part_bit_for_bit(tmp_path):
    run_dir = str(tmp_path / "run")
    calls: list[int] = []
    saver = _checkpointer(run_dir, seed=0, peers=_reward_rank(run_dir, calls))
    w = saver.run_file = _run_file(run_dir, 1)
    rng_before = determinism.capture_rng_state()
    final = saver.save(1)
    w.close()
    assert final == checkpoint.step_dir(run_dir, 1) == saver.last and calls == [1]
    assert checkpoint.problems(final) is None and run_state.problems(final, 1) is None
    assert not os.path.exists(checkpoint.partial_dir(run_dir, 1))
    # run.h5: every rank's RNG file as a row, then the checkpoint event, which its copy holds too
    run_h5 = os.path.join(run_dir, "run.h5")
    rows = runfile.read_rng(run_h5, 1)
    assert sorted(rows) == [0, 1] and rows[0] == rng_before and rows[0] != rows[1]
    assert rows == {r: checkpoint.read_rng(final, r) for r in range(WORLD)}
    events = [(e["step"], e["kind"], e["text"]) for e in runfile.read_run(run_h5).events]
    assert events[-1] == (1, "checkpoint", final)
    copy_events = runfile.read_run(run_state.run_state_path(final)).events
    assert (copy_events[-1]["step"], copy_events[-1]["kind"], copy_events[-1]["text"]) == events[-1]

    loader = _checkpointer(run_dir, seed=1)
    assert not _same_tensors(loader.parts["model"].policy.trainable, saver.parts["model"].policy.trainable)
    torch.manual_seed(99)
    said = []
    assert loader.load(_plan(1, final), lambda step, path: said.append((step, path))) == Resumed(1, final, "")
    assert said == [(1, final)] and loader.last == final
    assert _same_tensors(loader.parts["model"].policy.trainable, saver.parts["model"].policy.trainable)
    assert _same_tensors(loader.parts["model"].policy.shadow, saver.parts["model"].policy.shadow)
    a, b = loader.parts["optim"].optimizer.state_dict()["state"], saver.parts["optim"].optimizer.state_dict()["state"]
    assert a.keys() == b.keys() and all(torch.equal(a[k][n], b[k][n]) for k in a for n in a[k])
    assert loader.scaler.state_dict() == saver.scaler.state_dict() == {"scale": 16.0, "growth_tracker": 1}
    got = _draws()
    determinism.restore_rng_state(rng_before)
    assert got == _draws()  # rank 0's RNG is where it was when the checkpoint was taken


def test_a_fresh_plan_loads_nothing():
    c = _checkpointer("/nonexistent", seed=0)
    params = [p.detach().clone() for p in c.parts["model"].policy.trainable]
    said = []
    assert c.load(types.SimpleNamespace(checkpoint=None, rebuild_why="", aside_tag=""), said.append) == Resumed()
    assert said == [] and c.last == "" and _same_tensors(params, c.parts["model"].policy.trainable)


def test_a_failed_save_leaves_no_partial_and_the_last_good_checkpoint(tmp_path):
    run_dir = str(tmp_path / "run")
    c = _checkpointer(run_dir)
    good = c.save(1)

    def reward_rank_gone(step: int) -> None:
        raise RuntimeError("reward rank 1's snapshot timed out")
    c.peers = reward_rank_gone
    with pytest.raises(RuntimeError, match="timed out"):
        c.save(2)
    assert not os.path.exists(checkpoint.partial_dir(run_dir, 2))
    assert checkpoint.list_checkpoints(run_dir) == [(1, good)] and checkpoint.problems(good) is None
    assert c.last == good

    c.peers = None
    w = c.run_file = _run_file(run_dir, 2)

    def full_disk(path, extra_event=None):
        raise runfile.RunFileError(f"{path}: cannot write the run file (only 12 KiB free on its file system)")
    w.snapshot = full_disk
    try:
        with pytest.raises(checkpoint.CheckpointError, match="only 12 KiB free") as e:
            c.save(2)
        assert str(e.value).startswith(checkpoint.partial_dir(run_dir, 2))
    finally:
        w.close()
    assert not os.path.exists(checkpoint.partial_dir(run_dir, 2))
    assert checkpoint.list_checkpoints(run_dir) == [(1, good)] and c.last == good
    assert "checkpoint" not in [e["kind"] for e in runfile.read_run(os.path.join(run_dir, "run.h5")).events]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_damaged_run_file_is_rebuilt_on_rank_0_once_the_state_is_loaded(tmp_path, rank):
    run_dir = str(tmp_path / "run")
    saver = _checkpointer(run_dir, peers=_reward_rank(run_dir, []))
    w = saver.run_file = _run_file(run_dir, 1)
    final = saver.save(1)
    w.close()
    run_h5 = os.path.join(run_dir, "run.h5")
    good = runfile.read_run(run_h5)
    with open(run_h5, "r+b") as f:
        f.truncate(os.path.getsize(run_h5) // 2)
    damaged = open(run_h5, "rb").read()

    def loaded(step: int, path: str) -> None:  # the state is in place, run.h5 not yet touched
        assert open(run_h5, "rb").read() == damaged

    loader = _checkpointer(run_dir, seed=1, rank=rank)
    resumed = loader.load(_plan(1, final, "is damaged (truncated)", "damaged"), loaded)
    assert (resumed.step, resumed.path) == (1, final)
    assert _same_tensors(loader.parts["model"].policy.trainable, saver.parts["model"].policy.trainable)
    if rank:  # only rank 0 owns run.h5
        assert resumed.rebuilt == "" and open(run_h5, "rb").read() == damaged
        return
    aside = [n for n in os.listdir(run_dir) if n.startswith("run.h5.damaged-")]
    assert len(aside) == 1 and open(os.path.join(run_dir, aside[0]), "rb").read() == damaged
    assert resumed.rebuilt == (f"{run_h5} is damaged (truncated): rebuilt from checkpoint {final} (rows up to step 1)"
                               f"; the old file is kept as {os.path.join(run_dir, aside[0])}")
    rebuilt = runfile.read_run(run_h5)
    assert rebuilt.attrs[run_state.RUN_ID] == good.attrs[run_state.RUN_ID]
    assert all(np.array_equal(rebuilt.metrics[k], good.metrics[k], equal_nan=True) for k in good.metrics)
    assert runfile.read_rng(run_h5, 1) == runfile.read_rng(run_state.run_state_path(final), 1)


def test_a_rank_without_an_rng_file_keeps_its_rng(tmp_path):
    run_dir = str(tmp_path / "run")
    final = _checkpointer(run_dir).save(1)  # no reward rank: rank 1 wrote none
    before = determinism.capture_rng_state()
    assert restore_rank_rng(final, 1) is False and determinism.capture_rng_state() == before
    assert restore_rank_rng(final, 0) is True


def test_a_reward_ranks_rng_file_that_cannot_be_written_names_the_file(tmp_path, monkeypatch):
    # a write's own OSError names no file ("rank 2 (reward): OSError: [Errno 28]"): the line names it
    import errno
    import io as io_module

    run_dir = str(tmp_path / "run")
    os.makedirs(os.path.join(checkpoint.partial_dir(run_dir, 3), "rng"))

    class Full(io_module.BytesIO):
        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, mode="r", *a, **k: Full() if path.endswith("rank_2.bin")
                        else real_open(path, mode, *a, **k))
    with pytest.raises(checkpoint.CheckpointError) as e:
        snapshot_rank_rng(run_dir, 3, 2)
    path = checkpoint.rng_path(checkpoint.partial_dir(run_dir, 3), 2)
    assert str(e.value).startswith(f"{path}: cannot write the checkpoint (")
    assert "No space left on device" in str(e.value)


def test_with_the_rng_it_ended_with_a_step_abandoned_after_it_is_not_in_the_checkpoint(tmp_path):
    # a remote term's outage abandons step 3 after its draws began: the checkpoint of step 2 holds
    # the RNG state captured when step 2 ended, not the one the abandoned step left
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    ckpt = _checkpointer(run_dir)
    torch.manual_seed(5)
    ended = determinism.capture_rng_state()
    expected = _draws()
    torch.rand(100)  # the abandoned step's draws
    ckpt.save(2, ended)
    restore_rank_rng(checkpoint.step_dir(run_dir, 2), 0)
    assert _draws() == expected


def test_the_checkpointer_owns_its_schedule():
    """[checkpoint]'s every and at_end decide which steps are saved (keep: how many stay)."""
    on_count = Schedule(every=3, at_end=True, keep=2)
    assert [s for s in range(1, 11) if on_count.due(s, 10)] == [3, 6, 9, 10]
    assert [s for s in range(1, 11) if Schedule(0, True, 2).due(s, 10)] == [10]
    assert [s for s in range(1, 11) if Schedule(4, False, 2).due(s, 10)] == [4, 8]
    c = Checkpointer("unused", None, 0, 1, CONFIG, on_count, parts={})
    assert c.due(6, 10) and not c.due(7, 10)
