"""The learning signal is real: NFT raises PickScore on the tiny models, and lowers it when the
reward is negated. One prompt repeated over the groups of a step, because with distinct prompts
the tiny random reward is dominated by the prompt (tiny_models notes)."""
from __future__ import annotations

import numpy as np
import pytest

from jobs import hpcnft
from hpcnft.io.runfile import read_run

pytestmark = pytest.mark.slow

# The tiny PickScore of a prompt sits anywhere in about [-0.2, 0.15] (random embeddings); the
# rise NFT produces in 20 steps is about +0.005 whatever the prompt, so a relative criterion is
# only meaningful for a prompt whose starting reward is small and positive, as this one (~0.016).
PROMPT = "an owl perched on a branch at night"


def learn(tmp_path, scale: float) -> dict:
    prompts = tmp_path / "one_prompt.txt"
    prompts.write_text(PROMPT + "\n")
    run_dir = str(tmp_path / f"learn{scale:+.0f}")
    hpcnft("run", "tiny", "--steps", "20", "--run-dir", run_dir,
           "--set", "layout.train_ranks=1", "--set", "layout.reward_ranks=0",
           "--set", "rollout.prompts_per_step=4", "--set", "rollout.samples_per_prompt=8",
           "--set", "train.finetune=full", "--set", "optim.lr=1e-2",
           "--set", f"data.train_prompts={str(prompts)!r}", "--set", f"data.eval_prompts={str(prompts)!r}",
           "--set", "eval.every=20", "--set", "eval.at_start=true", "--set", "eval.num_prompts=1",
           "--set", f"reward.scale={scale}", "--set", "logging.sample_grid_every=0",
           "--set", "checkpoint.every=0", "--set", "checkpoint.at_end=false")
    return read_run(run_dir).metrics


def test_nft_raises_the_reward_and_the_negated_reward_lowers_it(tmp_path):
    up = learn(tmp_path, 1.0)
    pick = up["rollout/reward/raw_mean"][:, 1]
    assert pick[-5:].mean() >= 1.10 * pick[:5].mean(), pick
    ev = dict(up["eval/pickscore_mean"].tolist())
    assert ev[20.0] > ev[0.0]

    down = learn(tmp_path, -1.0)
    pick_down = -down["rollout/reward/raw_mean"][:, 1]  # the training reward is -PickScore
    assert pick_down[-5:].mean() < pick_down[:5].mean(), pick_down
    ev_down = dict(down["eval/pickscore_mean"].tolist())
    assert ev_down[20.0] < ev_down[0.0]
    assert np.isclose(ev_down[0.0], ev[0.0], rtol=0, atol=0)  # same start, the runs only diverge by training
