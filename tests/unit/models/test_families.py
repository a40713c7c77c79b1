"""The base-model families: FLUX.1-dev through the seam samples as FluxPipeline does (bit for
bit, same latents and embeddings), with its sigma grid, ids, timestep and embedded guidance; the
family is known by the DiT's class; levers written for SD3 are refused for FLUX."""
from __future__ import annotations

import pytest
import torch

from hpcnft.algo.root_config import ConfigError, load_config
from hpcnft.algo.sampler import PromptEncoder, euler_sample, guided_velocity, null_autocast
from hpcnft.models.families import FLUX, SD3, family_of
from hpcnft.models.families.flux import pack, unpack
from hpcnft.models.tiny import tree_digest
from hpcnft.models.tiny_flux import build_tiny_flux

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("flux") / "flux1_tiny"
    path.mkdir()
    return build_tiny_flux(str(path))


@pytest.fixture(scope="module")
def flux(flux_dir):
    return FLUX.load(flux_dir, torch.float32, CPU)


def test_two_builds_of_the_tiny_flux_are_byte_identical(flux_dir, tmp_path):
    again = tmp_path / "flux1_tiny"
    again.mkdir()
    assert tree_digest(build_tiny_flux(str(again))) == tree_digest(flux_dir)


def test_the_family_is_known_by_the_dit_class(flux, tiny_models):
    sd3 = SD3.load(tiny_models[0], torch.float32, CPU)
    assert family_of(flux.transformer) is FLUX and family_of(sd3.transformer) is SD3
    with pytest.raises(TypeError, match="no model family takes a Linear"):
        family_of(torch.nn.Linear(2, 2))


def test_the_transformer_stays_in_host_memory_for_the_policy_to_cast_first(tiny_models):
    # the other parts go where they are asked; the DiT waits in fp32 on the host (Policy casts
    # and stores it before the move, so a small card never holds its fp32 copy)
    pipe = SD3.load(tiny_models[0], torch.float32, torch.device("meta"), CPU)
    assert {p.device.type for p in pipe.vae.parameters()} == {"meta"}
    assert {p.device.type for enc in SD3.text_encoders(pipe) for p in enc.parameters()} == {"cpu"}
    assert {(p.device.type, p.dtype) for p in pipe.transformer.parameters()} == {("cpu", torch.float32)}
    assert not any(p.requires_grad for p in pipe.transformer.parameters()) and not pipe.transformer.training


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_text_encoders_are_read_straight_into_their_dtype_with_the_same_values(family, tiny_models, flux_dir):
    """A GPU run's text encoders in the compute dtype from the folder, no fp32 copy first: the
    values of the fp32 load cast, the DiT and VAE still in fp32."""
    from hpcnft.models.families import family_named

    fam, path = family_named(family), (tiny_models[0] if family == "sd3" else flux_dir)
    half = fam.load(path, torch.float32, CPU, None, torch.float16)
    full = fam.load(path, torch.float32, CPU)
    for a, b in zip(fam.text_encoders(half), fam.text_encoders(full)):
        assert {p.dtype for p in a.parameters()} == {torch.float16}
        assert all(torch.equal(x, y.to(torch.float16)) for x, y in zip(a.parameters(), b.parameters()))
    assert {p.dtype for p in half.transformer.parameters()} | {p.dtype for p in half.vae.parameters()} == \
        {torch.float32}


def test_packing_is_fluxpipelines_and_unpacking_inverts_it(flux):
    x = torch.randn(2, 16, 8, 6)
    tokens = pack(x)
    assert tokens.shape == (2, 4 * 3, 64)
    assert torch.equal(tokens, type(flux)._pack_latents(x, 2, 16, 8, 6))
    assert torch.equal(unpack(tokens, 8, 6), x)


@pytest.mark.parametrize("size,steps", [((64, 64), 10), ((64, 96), 4)])
def test_the_euler_rollout_is_fluxpipelines_bit_for_bit(flux, size, steps):
    """Same noise (drawn unpacked, as FluxPipeline.prepare_latents does, then packed for it), same
    embeddings, guidance 3.5: the final latents agree exactly, and so does the sigma grid the
    pipeline's scheduler ends up with."""
    height, width = size
    prompts = ["a photo of a cat sitting on a red chair", "a bowl of ramen with chopsticks"]
    cond = PromptEncoder(flux, 16, CPU, cfg=False)(prompts)
    shape = FLUX.latent_shape(flux, height, width)
    noise = torch.randn((2, *shape), generator=torch.Generator().manual_seed(0))
    sigmas = FLUX.sigma_grid(flux.scheduler, steps, shape)
    ours = euler_sample(flux.transformer, noise.clone(), sigmas, cond, 3.5, torch.float32, null_autocast)
    theirs = flux(prompt_embeds=cond.prompt_embeds, pooled_prompt_embeds=cond.pooled, latents=pack(noise),
                  guidance_scale=3.5, num_inference_steps=steps, height=height, width=width,
                  output_type="latent").images
    assert torch.equal(flux.scheduler.sigmas.float(), sigmas)
    assert torch.equal(ours, unpack(theirs, *shape[1:]))


def test_the_sigma_grid_shifts_with_resolution(flux):
    small = FLUX.sigma_grid(flux.scheduler, 10, (16, 8, 8))
    large = FLUX.sigma_grid(flux.scheduler, 10, (16, 128, 128))  # 1024 px
    assert small[0] == large[0] == 1.0 and small[-1] == large[-1] == 0.0
    assert (large[1:-1] > small[1:-1]).all()  # more image tokens, more time at high noise


def test_the_dit_gets_sigma_ids_and_the_guidance_in_one_pass(flux):
    seen = []
    hook = flux.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw), with_kwargs=True)
    try:
        cond = PromptEncoder(flux, 16, CPU, cfg=True)(["a red sports car parked on a wet street"])
        x = torch.randn(1, 16, 8, 8)
        guided_velocity(flux.transformer, x, torch.tensor(0.75), cond, 3.5, torch.float32, null_autocast)
    finally:
        hook.remove()
    assert len(seen) == 1  # no classifier-free guidance: FLUX.1-dev embeds the guidance value
    kw = seen[0]
    assert torch.equal(kw["guidance"], torch.tensor([3.5]))
    assert torch.equal(kw["timestep"], torch.tensor([750.0]) / 1000)
    assert kw["hidden_states"].shape == (1, 16, 64) and kw["img_ids"].shape == (16, 3)
    assert torch.equal(kw["img_ids"][:, 1:], torch.tensor([[r, c] for r in range(4) for c in range(4)]).float())
    assert torch.equal(kw["txt_ids"], torch.zeros(16, 3))


def test_prompts_encode_as_fluxpipeline_encodes_them(flux):
    pe, pooled = FLUX.encode_prompt(flux, "two dogs playing in the snow", 16, CPU)
    want_pe, want_pooled, _ = flux.encode_prompt("two dogs playing in the snow", max_sequence_length=16)
    assert torch.equal(pe, want_pe) and torch.equal(pooled, want_pooled)
    assert [name for name, _, _ in FLUX.token_limits(flux, 16)] == ["CLIP", "T5"]


@pytest.mark.parametrize("lever", ["fuse_qkv", "fused_lora", "gelu_epilogue", "rollout_fp8", "v_old_fp8"])
def test_levers_written_for_sd3_are_refused_for_flux(lever):
    with pytest.raises(ConfigError, match=f"perf.{lever}: works on SD3's blocks only"):
        load_config("tiny_flux", [f"perf.{lever}=true", "perf.merge_lora_nograd=true"])
    load_config("tiny", [f"perf.{lever}=true", "perf.merge_lora_nograd=true"])  # SD3 keeps them


def test_flux_takes_at_most_512_t5_tokens():
    assert load_config("flux1dev_pickscore").rollout.max_sequence_length == 512
    with pytest.raises(ConfigError, match="rollout.max_sequence_length: FLUX's T5 takes at most 512"):
        load_config("tiny_flux", ["rollout.max_sequence_length=513"])


def test_an_unknown_family_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="models.family: 'sdxl' is not one of sd3, flux, qwen_image"):
        load_config("tiny", ["models.family=sdxl"])


def test_cudnn_attention_is_refused_for_flux():
    with pytest.raises(ConfigError, match="perf.attention_backend: cuDNN's attention backward fails at FLUX.1's"):
        load_config("tiny_flux", ["perf.attention_backend=cudnn"])
    assert load_config("tiny_flux", ["perf.attention_backend=flash"]).perf.attention_backend == "flash"
