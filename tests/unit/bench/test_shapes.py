"""hpcnft bench's shapes beside SD3.5-M: SD3.5-Large, FLUX.1-dev, Qwen-Image and Wan2.1-T2V-1.3B at
their real sizes (built on the meta device, nothing allocated), their configs, and the tiny models'
plain stacks against the package's families; the DiT built in host memory with its random fills on
every core (CPU)."""
import pytest
import torch

from hpcnft.algo.root_config import load_config
from hpcnft.bench.levers import expand_levers, fast_overrides
from hpcnft.bench.random_models import build_dit, build_dit_on_host
from hpcnft.bench.shapes import REAL_SHAPES, SHAPES
from hpcnft.bench.stack import bench_config
from hpcnft.common.errors import UsageError
from hpcnft.perf.config import SD3_ONLY_LEVERS

CUDA = torch.device("cuda")  # a device name only: the configs are made without a GPU
CPU = torch.device("cpu")


def _params(name: str) -> int:
    dit = build_dit(SHAPES[name](), torch.device("meta"))
    return sum(p.numel() for p in dit.parameters())


@pytest.mark.parametrize("name,cls,low,high", [
    ("sd35m", "SD3Transformer2DModel", 2.24e9, 2.25e9),  # 2,243,171,520
    ("sd35l", "SD3Transformer2DModel", 8.05e9, 8.06e9),  # 8,056,627,520
    ("flux1dev", "FluxTransformer2DModel", 11.90e9, 11.91e9),  # 11,901,408,320
    ("qwen_image", "QwenImageTransformer2DModel", 20.43e9, 20.44e9),  # 20,430,401,088
    ("wan21_1_3b", "WanTransformer3DModel", 1.41e9, 1.42e9),  # 1,418,996,800
])
def test_real_shape_dits_have_the_published_sizes(name, cls, low, high):
    assert type(build_dit(SHAPES[name](), torch.device("meta"))).__name__ == cls
    assert low <= _params(name) <= high


def test_every_shapes_has_a_recipe_of_its_family_and_its_lora_targets():
    for name, make in SHAPES.items():
        S = make()
        recipe = load_config(S.recipe)
        assert recipe.models.family == S.family, name
        assert list(S.lora_targets) == recipe.train.lora_targets, name  # the recipe's LoRA, in both stacks
    assert set(REAL_SHAPES) == {"sd35m", "sd35l", "flux1dev", "qwen_image", "wan21_1_3b"}


def test_text_and_latent_shapes_follow_the_family():
    sd35l, flux, tiny_flux = SHAPES["sd35l"](), SHAPES["flux1dev"](), SHAPES["tiny_flux"]()
    assert sd35l.text_tokens == 77 + 256 and sd35l.pooled_width == 2048  # CLIP-L/G + T5; CLIP-L + CLIP-G pooled
    assert flux.text_tokens == 512 and flux.pooled_width == 768  # T5 alone; CLIP-L pooled
    assert tiny_flux.text_tokens == tiny_flux.t5_tokens
    for S in (sd35l, flux):
        assert S.latent_shape == (16, 64, 64)  # 512 px through the 8x VAE
    # FLUX packs 2x2 latent patches into its tokens; its rotary axes split one head
    for S in (flux, tiny_flux):
        assert S.dit["in_channels"] == 4 * S.vae["latent_channels"]
        assert sum(S.dit["axes_dims_rope"]) == S.dit["attention_head_dim"]
    assert (flux.vae["scaling_factor"], flux.vae["shift_factor"]) == (0.3611, 0.1159)
    assert flux.scheduler["use_dynamic_shifting"] and not sd35l.scheduler.get("use_dynamic_shifting", False)


def test_flux1dev_configs_are_bf16_lora_r64_with_checkpointing_and_no_sd3_levers():
    S = SHAPES["flux1dev"]()
    fast_over = fast_overrides(S, CUDA, [])
    assert not set(fast_over) & {f"perf.{k}" for k in SD3_ONLY_LEVERS}
    for over in ({}, fast_over):
        cfg = bench_config(S, CUDA, over)
        assert cfg.models.family == "flux" and cfg.train.precision == "bf16" and cfg.train.grad_checkpointing
        assert (cfg.train.lora_rank, cfg.train.lora_alpha, len(cfg.train.lora_targets)) == (64, 128, 12)
        assert (cfg.rollout.max_sequence_length, cfg.rollout.guidance_scale) == (512, 3.5)
        assert not any(getattr(cfg.perf, k) for k in SD3_ONLY_LEVERS)
    fast = bench_config(S, CUDA, fast_over)
    assert (fast.rollout.batch_size, fast.train.micro_batch, fast.perf.old_pass_batch) == (8, 4, 8)
    assert fast.perf.compile_blocks and fast.perf.merge_lora_nograd and fast.perf.skip_single_rank_fsdp
    assert fast.perf.vae_dtype == "bf16"  # FLUX's VAE in its DiT's dtype, as the plain stack runs it
    # the lever sweep leaves out what FLUX cannot take; asking for it is a usage error
    sweep = expand_levers(["all"], CUDA, S)
    assert sweep and not any(set(lever) & {f"perf.{k}" for k in SD3_ONLY_LEVERS} for lever in sweep)
    with pytest.raises(UsageError, match="fuse_qkv"):
        bench_config(S, CUDA, fast_overrides(S, CUDA, ["perf.fuse_qkv=true"]))


def test_sd35l_configs_are_fp16_at_its_batch_sizes_with_every_fast_lever():
    S = SHAPES["sd35l"]()
    cfg = bench_config(S, CUDA, fast_overrides(S, CUDA, []))
    assert cfg.models.family == "sd3" and cfg.train.precision == "fp16" and not cfg.train.grad_checkpointing
    assert (cfg.rollout.batch_size, cfg.train.micro_batch) == (max(S.rollout_batches), max(S.micro_batches))
    assert 2 in S.micro_batches  # the recipe's micro-batch
    assert cfg.perf.fuse_qkv and cfg.perf.fused_lora  # SD3's own levers apply to SD3.5-L
    assert bench_config(S, CPU, {}).train.precision == "fp32"


def test_tiny_flux_plain_stack_calls_the_dit_as_the_flux_family_does():
    """The eager stack's FluxPipeline-style call (packed latents, ids, guidance, time as sigma)
    and sigma grid against hpcnft's FLUX family, on the same weights."""
    from hpcnft.algo.sampler import velocity
    from hpcnft.bench.eager import EagerStack
    from hpcnft.bench.shapes import scheduler
    from hpcnft.models.families import FLUX

    S = SHAPES["tiny_flux"]()
    eager = EagerStack(S, CPU)
    dit = eager.dit
    eager.dit.disable_adapters()  # B = 0 anyway; the base model, as the rollout
    torch.testing.assert_close(eager.sigmas, FLUX.sigma_grid(scheduler(S), S.num_steps, S.latent_shape))
    x = eager._latent(3, seed=1)
    pe, pooled = eager._cond(3, seed=2)
    sigma = eager.sigmas[[1, 4, 7]]
    with torch.no_grad():
        mine = eager._velocity(x, sigma, pe, pooled)
        theirs = velocity(dit, x, sigma, pe, pooled, torch.float32, guidance=3.5)
    assert mine.shape == x.shape
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)


def test_qwen_image_shapes_are_its_recipes_with_a_masked_text_and_the_3d_vaes_latent():
    S, tiny = SHAPES["qwen_image"](), SHAPES["tiny_qwen_image"]()
    assert S.host_build and S.latent_shape == (16, 64, 64) and S.text_tokens == S.pooled_width == 512
    cfg = bench_config(S, CUDA, fast_overrides(S, CUDA, []))
    assert cfg.models.family == "qwen_image" and cfg.train.precision == "bf16" and cfg.train.grad_checkpointing
    assert (cfg.rollout.max_sequence_length, cfg.rollout.guidance_scale, cfg.samples_per_step) == (512, 4.0, 48)
    pe, mask = tiny.conditioning(2, 0, torch.float32)
    assert pe.shape == (2, tiny.text_tokens, tiny.dit["joint_attention_dim"]) and mask.dtype == torch.long
    assert tiny.latent_shape == (16, 8, 8)


def test_wan_shapes_are_its_recipes_videos_with_the_3d_vaes_latent():
    S, tiny = SHAPES["wan21_1_3b"](), SHAPES["tiny_wan"]()
    assert S.latent_shape == (16, 11, 60, 104) and (S.text_tokens, S.text_dim, S.pooled_width) == (512, 4096, 0)
    assert S.unit == "video" and SHAPES["qwen_image"]().unit == "image"
    cfg = bench_config(S, CUDA, fast_overrides(S, CUDA, []))
    assert cfg.models.family == "wan" and cfg.train.precision == "bf16" and cfg.train.grad_checkpointing
    assert (cfg.train.lora_rank, cfg.train.lora_alpha, cfg.samples_per_step) == (128, 128, 48)
    for shapes in (S, tiny):  # the recipe's videos, guidance and trained sigmas, which the eager stack uses too
        recipe, bench = load_config(shapes.recipe), bench_config(shapes, CPU, {})
        r = bench.rollout
        assert (r.height, r.width, r.num_frames) == (*shapes.hw, shapes.num_frames)
        assert (recipe.rollout.height, recipe.rollout.width) == (r.height, r.width)
        assert recipe.rollout.num_frames == r.num_frames
        assert recipe.rollout.guidance_scale == shapes.cfg_scale
        assert recipe.nft.timestep_fraction == shapes.timestep_fraction and bench.trained_steps == shapes.trained_steps
    assert (S.cfg_scale, S.trained_steps, tiny.cfg_scale, tiny.latent_shape) == (1.0, 4, 4.5, (16, 2, 8, 8))
    pe, pooled = tiny.conditioning(2, 0, torch.float32)
    assert pe.shape == (2, tiny.text_tokens, tiny.dit["text_dim"]) and pooled.shape == (2, 0)


@pytest.mark.parametrize("name", ["tiny_qwen_image", "tiny_wan"])
def test_tiny_plain_stack_calls_the_dit_and_the_vae_as_the_family_does(name):
    """The eager stack's QwenImagePipeline-style DiT call (packed latents, mask, image shapes, time
    as sigma) or WanPipeline-style one (video latents, time as 1000 sigma), sigma grid and decode
    against hpcnft's family, on the same weights."""
    from hpcnft.algo.sampler import decode_to_uint8, velocity
    from hpcnft.bench.eager import EagerStack
    from hpcnft.bench.shapes import scheduler
    from hpcnft.models.families import family_named

    S = SHAPES[name]()
    family = family_named(S.family)
    eager = EagerStack(S, CPU)
    dit = eager.dit
    eager.dit.disable_adapters()
    torch.testing.assert_close(eager.sigmas, family.sigma_grid(scheduler(S), S.num_steps, S.latent_shape))
    x = eager._latent(3, seed=1)
    pe, mask = eager._cond(3, seed=2)
    sigma = eager.sigmas[[1, 4, 7]]
    with torch.no_grad():
        mine = eager._velocity(x, sigma, pe, mask)
        theirs = velocity(dit, x, sigma, pe, mask, torch.float32)
    assert mine.shape == x.shape
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)
    assert torch.equal(eager._decode(x[:1]), decode_to_uint8(eager.vae, x[:1], family=family))


def test_tiny_wan_plain_stack_guides_as_wanpipeline_and_scores_each_videos_frames():
    """The eager rollout's CFG (the conditional call, then the negative prompt's) against the
    package's guided velocity; PickScore of a video is its frames' mean."""
    from hpcnft.algo.sampler import Conditioning, guided_velocity, null_autocast
    from hpcnft.bench.eager import EagerStack
    from hpcnft.bench.shapes import random_images

    S = SHAPES["tiny_wan"]()
    eager = EagerStack(S, CPU)
    eager.dit.disable_adapters()
    x, (pe, pooled), neg = eager._latent(2, seed=1), eager._cond(2, seed=2), eager._cond(1, seed=3)
    sigma = eager.sigmas[2].expand(2)
    cond = Conditioning(pe, pooled)
    cond.neg_prompt_embeds, cond.neg_pooled = neg[0].expand_as(pe), neg[1].expand_as(pooled)
    with torch.no_grad():
        mine = eager._guided_velocity(x, sigma, pe, pooled, neg)
        theirs = guided_velocity(eager.dit, x, sigma, cond, S.cfg_scale, torch.float32, null_autocast)
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)
    videos = random_images(S, 2, videos=True)
    assert videos.shape == (2, S.num_frames, *S.hw, 3)
    prompts = ["a red fox", "a blue car"]
    frames = eager._score(["a red fox"] * S.num_frames + ["a blue car"] * S.num_frames, videos.flatten(0, 1))
    torch.testing.assert_close(eager._score_samples(prompts, videos), frames.view(2, -1).mean(1))


@pytest.mark.parametrize("name", ["tiny", "tiny_flux"])
def test_the_host_build_draws_the_init_functions_fills_on_every_core_the_same_each_time(name):
    import math

    S = SHAPES[name]()
    uniform = torch.nn.init.uniform_
    one, two, plain = build_dit_on_host(S), build_dit_on_host(S), build_dit(S, CPU)
    assert torch.nn.init.uniform_ is uniform  # put back
    a, ref = one.state_dict(), plain.state_dict()
    assert list(a) == list(ref) and all(a[k].shape == ref[k].shape and a[k].dtype == ref[k].dtype for k in a)
    assert all(torch.equal(x, y) for x, y in zip(one.parameters(), two.parameters()))
    # computed, not drawn (diffusers' sin/cos tables can differ in the last bit with their memory's alignment)
    for x, y in zip(one.buffers(), plain.buffers()):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
    for m in one.modules():  # nn.Linear's kaiming_uniform(a=sqrt(5)) and bias bounds: 1/sqrt(fan_in)
        if isinstance(m, torch.nn.Linear):
            bound = 1 / math.sqrt(m.in_features)
            for p in (m.weight, m.bias) if m.bias is not None else (m.weight,):
                assert torch.isfinite(p).all() and 0 < p.abs().max() <= bound * (1 + 1e-6)


def test_a_host_built_stack_trains_the_host_builds_weights():
    # what a capped stack (hpcnft bench --memory-cap-gib) wraps in its Policy
    import torch.distributed as dist

    from hpcnft.bench.shapes import _MESH
    from hpcnft.bench.stack import HpcnftStack

    S = SHAPES["tiny"]()
    stack = HpcnftStack("t", "t", S, CPU, {}, host_build=True)
    try:
        built = dict(build_dit_on_host(S).named_parameters())
        base = {n.replace(".base_layer", ""): p.full_tensor() if hasattr(p, "full_tensor") else p
                for n, p in stack.policy.transformer.named_parameters() if not p.requires_grad}
        assert set(base) == set(built) and all(torch.equal(base[n], built[n]) for n in built)
    finally:
        stack.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        _MESH.clear()
