"""`hpcnft export` writes what diffusers loads, and the loaded weights reproduce the policy."""
from __future__ import annotations

import pytest
import torch

from jobs import hpcnft
from hpcnft.algo import nft
from hpcnft.algo.prompts import PromptStream, read_prompt_file
from hpcnft.rewards.pickscore import PickScoreScorer
from hpcnft.algo.sampler import (PromptEncoder, decode_to_uint8, euler_sample, initial_noise, null_autocast,
                            sigma_grid)
from hpcnft.common.config import load_config
from hpcnft.io.runfile import read_run
from hpcnft.models.loading import load_pickscore, load_sd3_pipeline, resolve_model_paths

pytestmark = pytest.mark.slow


def rollout_reward_with(lora_dir: str, step: int) -> float:
    """Step `step`'s rollout of the tiny recipe, sampled by a plain diffusers pipeline that
    loaded the exported adapters with `load_lora_weights`, in the run's chunks of 4."""
    torch.set_num_threads(1)  # the run's determinism.cpu_threads
    cfg, cpu = load_config("tiny"), torch.device("cpu")
    paths = resolve_model_paths(cfg)
    pipe = load_sd3_pipeline(paths.base, torch.float32, cpu)
    pipe.load_lora_weights(lora_dir)
    scorer = PickScoreScorer(*load_pickscore(paths.pickscore, paths.pickscore_processor, cpu), cpu)
    encode = PromptEncoder(pipe, cfg.rollout.max_sequence_length, cpu, cfg=False)
    sigmas = sigma_grid(pipe.scheduler, cfg.rollout.num_steps)
    prompts = PromptStream(read_prompt_file(cfg.data.train_prompts, "p"), False, 0).for_step(step, 4)
    scores = []
    for start in range(0, 16, 4):
        ids = list(range(start, start + 4))
        texts = [prompts[i // 4] for i in ids]
        noise = initial_noise((16, 8, 8), cfg.rollout.seed, step, ids, "rollout_noise")
        x0 = euler_sample(pipe.transformer, noise, sigmas, encode(texts), 1.0, torch.float32, null_autocast)
        scores.append(scorer(texts, decode_to_uint8(pipe.vae, x0)))
    return nft.reward_stats(torch.cat(scores))["raw_mean"]


def test_exported_old_policy_reproduces_the_next_rollout(tmp_path):
    run_dir, out = str(tmp_path / "run"), str(tmp_path / "lora")
    hpcnft("run", "tiny", "--steps", "3", "--run-dir", run_dir, "--set", "checkpoint.every=2")
    r = hpcnft("export", run_dir, out, "--step", "2", "--policy", "old")
    assert "step 2" in r.stdout
    assert "torch.distributed is disabled" not in r.stderr  # one process without a group is by design
    # the rollout of step 3 is sampled by the old policy as it stood after step 2
    expected = read_run(run_dir).metrics["rollout/reward/raw_mean"][2, 1]
    assert rollout_reward_with(out, 3) == expected


def test_export_without_a_checkpoint_is_one_line(tmp_path):
    r = hpcnft("export", str(tmp_path), str(tmp_path / "out"), check=False)
    assert r.returncode == 2 and "no complete checkpoint" in r.stderr and "Traceback" not in r.stderr
