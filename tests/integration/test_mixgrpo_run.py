"""MixGRPO end to end (`tiny_learns_mixgrpo`: the real 2 + 1 layout over gloo), its window moving
every step: a run preempted after step 1 and resumed ends with the uninterrupted run's bits; the
run file holds MixGRPO's keys, the window's start among them, and the progress line its loss."""
from __future__ import annotations

import pytest

from jobs import assert_same_metrics, hpcnft
from hpcnft.algo.mixgrpo.spec import TRAIN_KEYS
from hpcnft.io.runfile import read_run

pytestmark = pytest.mark.slow

RECIPE, STEPS = "tiny_learns_mixgrpo", "3"
ARGS = ("--set", "checkpoint.every=1", "--set", "mixgrpo.window_every=1", "--set", "eval.at_start=false")


def test_a_resumed_mixgrpo_run_has_the_uninterrupted_bits_and_its_window_moves(tmp_path):
    straight, cut = str(tmp_path / "straight"), str(tmp_path / "cut")
    out = hpcnft("run", RECIPE, "--steps", STEPS, "--run-dir", straight, *ARGS).stdout
    assert "| mix_loss " in out
    hpcnft("run", RECIPE, "--steps", "1", "--run-dir", cut, *ARGS)
    hpcnft("run", RECIPE, "--steps", STEPS, "--run-dir", cut, *ARGS)
    assert_same_metrics(straight, cut)
    m = read_run(straight).metrics
    for key in TRAIN_KEYS:
        assert m[key][:, 0].tolist() == [1.0, 2.0, 3.0], key
    assert m["train/mix_window_start"][:, 1].tolist() == [0.0, 1.0, 2.0]  # one step on, every step
    assert (m["train/mix_num_timesteps"][:, 1] == 4).all() and (m["ema/decay"][:, 1] == 0).all()
    assert 0 < m["train/mix_clipfrac"][:, 1].max() < 1  # the second update of a step runs off-policy
