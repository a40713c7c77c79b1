"""`hpcnft export` writes what diffusers loads, and the loaded weights reproduce the policy: for
each base-model family, its own diffusers pipeline (StableDiffusion3Pipeline, FluxPipeline) with
`load_lora_weights`."""
from __future__ import annotations

import diffusers
import pytest
import torch

from jobs import hpcnft
from hpcnft.algo import nft
from hpcnft.algo.prompts import PromptStream, read_prompt_file
from hpcnft.rewards.pickscore import PickScoreScorer
from hpcnft.algo.sampler import PromptEncoder, decode_to_uint8, euler_sample, initial_noise, null_autocast
from hpcnft.common.config import load_config
from hpcnft.io.runfile import read_run
from hpcnft.models.loading import base_family, load_pickscore, resolve_model_paths


def rollout_reward_with(recipe: str, lora_dir: str, step: int) -> float:
    """Step `step`'s rollout of `recipe`, sampled by the family's plain diffusers pipeline that
    loaded the exported adapters with `load_lora_weights`, in the run's chunks: the family's sigma
    grid, and its guidance (FLUX.1-dev embeds rollout.guidance_scale in its one pass)."""
    torch.set_num_threads(1)  # the run's determinism.cpu_threads
    cfg, cpu = load_config(recipe), torch.device("cpu")
    r, family, paths = cfg.rollout, base_family(cfg), resolve_model_paths(cfg)
    pipe = family.load(paths.base, torch.float32, cpu)
    assert isinstance(pipe, getattr(diffusers, family.pipeline_class))
    pipe.load_lora_weights(lora_dir)
    scorer = PickScoreScorer(*load_pickscore(paths.pickscore, paths.pickscore_processor, cpu), cpu)
    encode = PromptEncoder(pipe, r.max_sequence_length, cpu, cfg=r.guidance_scale > 1.0 and family.cfg_guidance)
    latent_shape = family.latent_shape(pipe, r.height, r.width)
    sigmas = family.sigma_grid(pipe.scheduler, r.num_steps, latent_shape)
    prompts = PromptStream(read_prompt_file(cfg.data.train_prompts, "p"), False, 0).for_step(step, r.prompts_per_step)
    scores = []
    for start in range(0, r.prompts_per_step * r.samples_per_prompt, r.batch_size):
        ids = list(range(start, start + r.batch_size))
        texts = [prompts[i // r.samples_per_prompt] for i in ids]
        noise = initial_noise(latent_shape, r.seed, step, ids, "rollout_noise")
        x0 = euler_sample(pipe.transformer, noise, sigmas, encode(texts), r.guidance_scale, torch.float32,
                          null_autocast)
        scores.append(scorer(texts, decode_to_uint8(pipe.vae, x0)))
    return nft.reward_stats(torch.cat(scores))["raw_mean"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tiny", "tiny_flux"])
def test_exported_old_policy_reproduces_the_next_rollout(recipe, request, tmp_path):
    """From the session's 3-step runs of each family, their checkpoint after step 2."""
    run_dir = request.getfixturevalue("tiny_run").run_dir if recipe == "tiny" else \
        request.getfixturevalue("tiny_flux_run")
    out = str(tmp_path / "lora")
    r = hpcnft("export", run_dir, out, "--step", "2", "--policy", "old")
    assert "step 2" in r.stdout
    assert "torch.distributed is disabled" not in r.stderr  # one process without a group is by design
    # the rollout of step 3 is sampled by the old policy as it stood after step 2
    expected = read_run(run_dir).metrics["rollout/reward/raw_mean"][2, 1]
    assert rollout_reward_with(recipe, out, 3) == expected


def test_export_without_a_checkpoint_is_one_line(tmp_path):
    r = hpcnft("export", str(tmp_path), str(tmp_path / "out"), check=False)
    assert r.returncode == 2 and "no complete checkpoint" in r.stderr and "Traceback" not in r.stderr
