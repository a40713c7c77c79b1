"""Wan2.1 text-to-video through the family seam: the tiny Wan samples as WanPipeline does (bit for
bit: the same latents, frames and embeddings, classifier-free guidance included), with its sigma
grid, the DiT's timestep and two CFG passes; the rollout's frame count is checked against the
family."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hpcnft.algo.root_config import ConfigError, load_config
from hpcnft.algo.sampler import PromptEncoder, decode_to_uint8, euler_sample, guided_velocity, null_autocast
from hpcnft.models.families import WAN, family_of
from hpcnft.models.families.wan import latent_frames
from hpcnft.models.tiny import tree_digest
from hpcnft.models.tiny_wan import build_tiny_wan

CPU = torch.device("cpu")
PROMPTS = ["a photo of a cat sitting on a red chair", "a bowl of ramen with chopsticks"]


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("wan") / "wan21_tiny"
    path.mkdir()
    return build_tiny_wan(str(path))


@pytest.fixture(scope="module")
def wan(wan_dir):
    return WAN.load(wan_dir, torch.float32, CPU)


def test_two_builds_of_the_tiny_wan_are_byte_identical(wan_dir, tmp_path):
    again = tmp_path / "wan21_tiny"
    again.mkdir()
    assert tree_digest(build_tiny_wan(str(again))) == tree_digest(wan_dir)


def test_the_family_is_known_by_the_dit_class(wan):
    assert family_of(wan.transformer) is WAN and WAN.video and not WAN.cfg_batched


@pytest.mark.parametrize("size,frames,steps", [((64, 64), 5, 6), ((32, 48), 9, 3)])
def test_the_guided_rollout_and_its_frames_are_wanpipelines_bit_for_bit(wan, size, frames, steps):
    """Same noise, same embeddings (the empty negative prompt's too), guidance 4.5: the final
    latents agree exactly, so do the decoded frames (WanPipeline's postprocessed video, rounded to
    uint8) and the sigma grid the pipeline's scheduler ends up with."""
    height, width = size
    cond = PromptEncoder(wan, 16, CPU, cfg=True)(PROMPTS)
    shape = WAN.latent_shape(wan, height, width, frames)
    assert shape == (16, latent_frames(frames), height // 8, width // 8)
    noise = torch.randn((2, *shape), generator=torch.Generator().manual_seed(0))
    sigmas = WAN.sigma_grid(wan.scheduler, steps, shape)
    ours = euler_sample(wan.transformer, noise.clone(), sigmas, cond, 4.5, torch.float32, null_autocast)
    args = dict(prompt_embeds=cond.prompt_embeds, negative_prompt_embeds=cond.neg_prompt_embeds, guidance_scale=4.5,
                num_inference_steps=steps, height=height, width=width, num_frames=frames)
    theirs = wan(latents=noise.clone(), output_type="latent", **args).frames
    assert torch.equal(wan.scheduler.sigmas.float(), sigmas)
    assert torch.equal(ours, theirs)
    video = wan(latents=noise.clone(), output_type="np", **args).frames  # [B, F, H, W, 3] in 0..1
    frames_u8 = decode_to_uint8(wan.vae, ours, family=WAN)
    assert frames_u8.shape == (2, frames, height, width, 3)
    assert torch.equal(frames_u8, torch.from_numpy((video * 255).round().astype(np.uint8)))


def test_the_grid_of_the_real_folders_unipc_is_the_euler_grid_at_its_flow_shift(wan):
    """Wan2.1-T2V-1.3B ships UniPC with flow_shift 3.0: the sampler walks the Euler grid at that
    shift, the tiny folder's own scheduler's."""
    from diffusers import UniPCMultistepScheduler

    unipc = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                    num_train_timesteps=1000)
    for steps in (6, 20):
        assert torch.equal(WAN.sigma_grid(unipc, steps, None), WAN.sigma_grid(wan.scheduler, steps, None))
    shifted = WAN.sigma_grid(UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=8.0), 6, None)
    assert (shifted[1:-1] > WAN.sigma_grid(unipc, 6, None)[1:-1]).all()


def test_the_dit_gets_1000_sigma_and_the_text_positive_pass_first(wan):
    seen = []
    hook = wan.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw), with_kwargs=True)
    try:
        cond = PromptEncoder(wan, 16, CPU, cfg=True)(["a red sports car parked on a wet street"])
        x = torch.randn(1, *WAN.latent_shape(wan, 32, 32, 5))
        guided_velocity(wan.transformer, x, torch.tensor(0.75), cond, 4.5, torch.float32, null_autocast)
    finally:
        hook.remove()
    assert len(seen) == 2  # CFG as WanPipeline: the positive pass, then the negative one
    assert [kw["hidden_states"].shape for kw in seen] == [(1, 16, 2, 4, 4)] * 2
    assert all(torch.equal(kw["timestep"], torch.tensor([750.0])) for kw in seen)
    assert torch.equal(seen[0]["encoder_hidden_states"], cond.prompt_embeds)
    assert torch.equal(seen[1]["encoder_hidden_states"], cond.neg_prompt_embeds)


def test_prompts_encode_as_wanpipeline_encodes_them(wan):
    pe, second = WAN.encode_prompt(wan, "two dogs playing in the snow", 16, CPU)
    want, _ = wan.encode_prompt("two dogs playing in the snow", do_classifier_free_guidance=False,
                                max_sequence_length=16)
    assert torch.equal(pe, want) and second.shape == (1, 0)
    tokens = len(wan.tokenizer("two dogs playing in the snow")["input_ids"])
    assert pe[0, tokens:].abs().sum() == 0 and pe[0, :tokens].abs().sum() > 0  # zeros past the prompt
    assert [name for name, _, _ in WAN.token_limits(wan, 16)] == ["UMT5"] and WAN.prompt_tokens(16) == 16


def test_the_frame_count_is_checked_against_the_family():
    assert load_config("tiny_wan").rollout.num_frames == 5
    with pytest.raises(ConfigError, match=r"rollout.num_frames: Wan's VAE takes 1 \+ 4k frames .* got 6"):
        load_config("tiny_wan", ["rollout.num_frames=6"])
    with pytest.raises(ConfigError, match="rollout.num_frames: models.family='sd3' makes images; frames need"):
        load_config("tiny", ["rollout.num_frames=5"])
    with pytest.raises(ConfigError, match="rollout.batch_size: a chunk of 4 videos of 1021 frames of 512x512 is"):
        load_config("tiny_wan", ["rollout.num_frames=1021", "rollout.height=512", "rollout.width=512"])
    with pytest.raises(ConfigError, match="rollout.batch_size: a chunk of 8 videos of 1021 frames is 8168 images"):
        load_config("tiny_wan", ["rollout.num_frames=1021", "rollout.batch_size=8", "rollout.height=16",
                                 "rollout.width=16"])
