"""[watch]'s measures against hand computations on tiny inputs (hpcnft.algo.watch), the guard's
rule and the best checkpoint (hpcnft.run.guard), and the best checkpoint surviving pruning."""
from __future__ import annotations

import json
import os

import pytest
import torch

from hpcnft.algo.root_config import ConfigError, load_config
from hpcnft.algo.watch import group_diversity, thumbnails, velocity_drift
from hpcnft.io.checkpoint_dirs import prunable, read_best, write_best
from hpcnft.run.guard import Guard


def test_thumbnails_average_each_area_into_0_to_1():
    img = torch.zeros(1, 4, 4, 3, dtype=torch.uint8)
    img[0, :2, :2] = 255  # the top-left quarter white
    t = thumbnails(img, side=2).reshape(3, 2, 2)
    assert t[:, 0, 0].tolist() == [1.0, 1.0, 1.0] and t[:, 1, 1].tolist() == [0.0, 0.0, 0.0]


def test_diversity_is_the_mean_pairwise_rms_distance_within_groups():
    black, white, grey = torch.zeros(4), torch.ones(4), torch.full((4,), 0.5)
    # group 1: black, white (RMS distance 1); group 2: grey, grey (0)
    assert group_diversity(torch.stack([black, white, grey, grey]).double(), 2) == pytest.approx(0.5)
    # one group of three: pairs (b,w)=1, (b,g)=0.5, (w,g)=0.5, each counted both ways: mean 2/3
    assert group_diversity(torch.stack([black, white, grey]).double(), 3) == pytest.approx(2 / 3)
    assert group_diversity(torch.stack([grey, grey]).double(), 2) == 0.0  # collapse


def test_drift_is_the_mean_squared_velocity_difference_per_sample():
    a = torch.tensor([[[1.0, 3.0]], [[0.0, 0.0]]])
    b = torch.tensor([[[0.0, 1.0]], [[0.0, 0.0]]])
    assert velocity_drift(a, b).tolist() == [2.5, 0.0]  # (1 + 4) / 2


def rows(*evals):
    """run.h5-like rows: (step, held-out value, trained reward) each."""
    return [(s, {"eval/judge_mean": v, "rollout/reward/raw_mean": r}) for s, v, r in evals]


def test_the_guard_fires_where_the_judge_falls_past_the_drop_while_the_reward_rises():
    g = Guard("eval/judge_mean", 0.1, "")
    verdicts = [g.observe(s, m) for s, m in rows((1, 0.50, 0.1), (2, 0.45, 0.3), (3, 0.35, 0.4), (4, 0.36, 0.5))]
    assert [v.fired for v in verdicts] == [False, False, True, True]  # 0.05 is within the drop; 0.15 is not
    assert verdicts[2].text == ("guard: eval/judge_mean fell 0.15 from its best 0.5 (step 1) to 0.35 while the "
                                "trained reward rose 0.3 (0.1 -> 0.4)")


@pytest.mark.parametrize("evals", [
    ((1, 0.5, 0.1), (2, 0.3, 0.05), (3, 0.2, 0.0)),  # the judge falls, but so does the reward: not a hack
    ((1, 0.5, 0.1), (2, 0.6, 0.3), (3, 0.7, 0.9)),  # both rise
    ((1, 0.5, 0.1), (2, 0.45, 0.9)),  # the reward soars, the judge within the drop
])
def test_the_guard_stays_quiet_where_it_must(evals):
    g = Guard("eval/judge_mean", 0.1, "")
    assert not any(g.observe(s, m).fired for s, m in rows(*evals))


def test_the_best_is_where_the_kept_metric_is_highest_and_a_replay_restores_it():
    g = Guard("", 0.0, "eval/judge_mean")
    assert [g.observe(s, m).new_best for s, m in rows((1, 0.2, 0), (2, 0.5, 0), (3, 0.4, 0))] == [True, True, False]
    again = Guard("", 0.0, "eval/judge_mean")
    again.replay(dict(rows((1, 0.2, 0), (2, 0.5, 0), (3, 0.4, 0))))
    assert (again.kept.step, again.kept.value) == (2, 0.5)
    assert not again.observe(4, {"eval/judge_mean": 0.45}).new_best  # the resumed run decides as the whole one
    base = Guard("eval/judge_mean", 0.1, "eval/judge_mean")  # eval.at_start: step 0 is the base's evaluation
    assert not base.observe(0, {"eval/judge_mean": 0.9}).new_best  # no checkpoint of step 0 to keep
    # the base's best is beaten by no trained reward until there is one: step 1's is the one to beat
    assert not base.observe(1, {"eval/judge_mean": 0.7, "rollout/reward/raw_mean": -4.0}).fired
    assert base.observe(2, {"eval/judge_mean": 0.7, "rollout/reward/raw_mean": -3.9}).fired  # 0.2 below the base


def test_pruning_keeps_the_best_checkpoint_beside_the_newest(tmp_path):
    run = str(tmp_path)
    for step in (1, 2, 3, 4):
        os.makedirs(os.path.join(run, "checkpoints", f"step_{step:06d}"))
    write_best(run, 2, "eval/judge_mean", 0.5)
    assert read_best(run) == {"step": 2, "metric": "eval/judge_mean", "value": 0.5}
    assert [os.path.basename(p) for p in prunable(run, 1)] == ["step_000001", "step_000003"]
    with open(os.path.join(run, "checkpoints", "BEST"), "w") as f:
        json.dump(["not", "a", "record"], f)
    assert read_best(run) is None  # unreadable: nothing is spared, nothing breaks


@pytest.mark.parametrize("over,match", [
    (["watch.guard_metric=eval/aesthetic_mean"], "watch.guard_metric: 'eval/aesthetic_mean' is not an evaluation"),
    (["checkpoint.keep_best=rollout/reward/raw_mean"], "checkpoint.keep_best: 'rollout/reward/raw_mean' is not"),
    (["watch.drift_sigmas=[0.0]"], "watch.drift_sigmas: 0.0 is not a noise level"),
])
def test_what_the_watch_cannot_measure_is_refused_naming_the_key(over, match):
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace(")", r"\)")):
        load_config("tiny", over)
