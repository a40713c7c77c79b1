"""The tiny twin of the official recipe end to end: 3 ranks (2 train + 1 reward) with DPM-Solver++
2M rollouts, integer timesteps, sigmas drawn per sample, advantages by prompt text, KL to the
base and the evaluation EMA of theta; reproducible, and resumed bit for bit (the evaluation EMA
comes back from the checkpoint)."""
from __future__ import annotations

import numpy as np
import pytest

from jobs import assert_same_metrics, hpcnft
from hpcnft.io.runfile import read_run

pytestmark = pytest.mark.slow

STEPS = "4"
SETTINGS = ["--set", "eval.every=2", "--set", "checkpoint.every=2"]


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("official") / "run")
    hpcnft("run", "tiny_official", "--steps", STEPS, "--run-dir", run_dir, *SETTINGS)
    return run_dir


def test_the_official_options_reach_the_run(official):
    run = read_run(official)
    m = run.metrics
    assert run.config["rollout"]["solver"] == "dpm2" and run.config["eval"]["policy"] == "ema"
    assert m["train/nft_pos_loss"][0, 1] == m["train/nft_neg_loss"][0, 1]  # step 1: pi_old == theta
    assert "train/kl_loss" in m and np.all(m["train/kl_loss"][1:, 1] > 0)  # the policy leaves the base
    # sigmas drawn per sample: the mean trained sigma moves from step to step ("first" keeps it fixed)
    assert len(set(m["train/nft_t_mean"][:, 1].tolist())) > 1
    # the evaluation before step 1 and every 2 steps, on the EMA of theta
    assert m["eval/pickscore_mean"][:, 0].tolist() == [0.0, 2.0, 4.0]


def test_same_command_twice_is_bit_identical(official, tmp_path):
    again = str(tmp_path / "again")
    hpcnft("run", "tiny_official", "--steps", STEPS, "--run-dir", again, *SETTINGS)
    assert_same_metrics(official, again)


def test_a_resumed_run_ends_with_the_same_bits(official, tmp_path):
    """Stopped after step 2 and resumed: the step-4 evaluation samples with the evaluation EMA,
    which only matches if the checkpoint brought it back."""
    resumed = str(tmp_path / "resumed")
    hpcnft("run", "tiny_official", "--steps", "2", "--run-dir", resumed, *SETTINGS)
    hpcnft("run", "tiny_official", "--steps", STEPS, "--run-dir", resumed, *SETTINGS)
    assert_same_metrics(official, resumed)
