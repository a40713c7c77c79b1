"""Several reward terms end to end (tiny_multireward): the training reward is the weighted sum
of the terms' scores, every term has its rollout and eval metrics, evaluation-only terms are
scored at evaluation only, and 2+2 (two reward ranks, each serving its train rank) gives the
bits of 2+1. The first run builds every tiny model into an empty cache, on the reward rank too
(rank 2: the terms' models must be written before the process group exists)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from jobs import assert_same_metrics, hpcnft
from hpcnft.algo.root_config import config_from_dict
from hpcnft.io.runfile import read_run
from hpcnft.rewards.registry import job_terms

pytestmark = pytest.mark.slow

ARGS = ["--steps", "2", "--set", "eval.every=2", "--set", "checkpoint.every=0"]


@pytest.fixture(scope="module")
def two_plus_one(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("multi") / "run")
    cache = str(tmp_path_factory.mktemp("empty-cache"))
    hpcnft("run", "tiny_multireward", "--run-dir", run_dir, *ARGS, "--set", f"models.tiny_cache={cache!r}")
    return run_dir


def test_every_term_is_reported_and_the_reward_is_their_weighted_sum(two_plus_one):
    run = read_run(two_plus_one)
    terms = job_terms(config_from_dict(run.config))
    training = [t for t in terms if not t.eval_only]
    assert len(training) >= 2 and any(t.eval_only for t in terms)
    m = run.metrics
    for t in terms:
        assert m[f"eval/{t.name}_mean"][:, 0].tolist() == [2.0]
        assert (f"rollout/reward/{t.name}/mean" in m) == (not t.eval_only)
    for step in (0, 1):  # the mean of a weighted sum is the weighted sum of the means
        mix = sum(t.weight * m[f"rollout/reward/{t.name}/mean"][step, 1] for t in training)
        assert m["rollout/reward/raw_mean"][step, 1] == pytest.approx(mix, rel=1e-5, abs=1e-7)
    stds = [m[f"rollout/reward/{t.name}/std"][:, 1] for t in training]
    assert all(np.all(s > 0) for s in stds)


def test_two_reward_ranks_give_the_bits_of_one(two_plus_one, tmp_path):
    run_dir = str(tmp_path / "two_reward_ranks")
    hpcnft("run", "tiny_multireward", "--run-dir", run_dir, *ARGS, "--set", "layout.reward_ranks=2")
    assert json.loads(read_run(run_dir).topology["reward_ranks"]) == [2, 3]
    assert_same_metrics(two_plus_one, run_dir)
