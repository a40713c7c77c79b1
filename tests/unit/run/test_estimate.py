"""hpcnft.run.estimate: the DiT FLOP count of a step (against a hand count, torch's FLOP counter
and the bench's count at the real shapes), the note on a recipe file without `base`, and when
`hpcnft run` warns that a step will be long."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from hpcnft.algo.root_config import Config, load_config
from hpcnft.common.validation import flatten
from hpcnft.models.tiny import TINY_TRANSFORMER
from hpcnft.models.tiny_flux import TINY_FLUX_TRANSFORMER
from hpcnft.run import estimate
from hpcnft.run.estimate import (DitDims, dit_forward_flops, image_tokens, pair_flops, startup_notes, step_flops,
                                 text_tokens)

TINY = DitDims.from_config("sd3", TINY_TRANSFORMER)


def test_tiny_dit_forward_by_hand():
    # The tiny recipe: 64x64 -> an 8x8 latent -> 4x4 patches = 16 image tokens; 77 CLIP + 16 T5
    # text tokens. Width 32, 2 blocks (the last one's text stream: q, k, v only), block 0 dual.
    w, i, t = 32, 16, 93
    assert (image_tokens(TINY, 64, 64), text_tokens("sd3", 16)) == (i, t)
    linear = (2 * i * 16 * 4 * w  # patch embedding: 16 channels x 2x2 -> 32
              + 2 * t * 64 * w  # text embedding: 64 -> 32
              + 2 * i * w * 4 * 16  # output projection
              + 2 * (2 * 12 * w * w * i)  # both blocks' image streams
              + 2 * 12 * w * w * t + 2 * 3 * w * w * t  # text streams: block 0 whole, block 1 q, k, v
              + 2 * 4 * w * w * i)  # the dual block's image-only attention projections
    attention = 2 * 4 * (i + t) ** 2 * w + 4 * i ** 2 * w
    f = dit_forward_flops(TINY, i, t)
    assert (f.linear, f.attention) == (linear, attention) == (4_286_464, 3_074_304)


def test_tiny_recipe_step_by_hand():
    f = dit_forward_flops(TINY, 16, 93)
    s = step_flops(load_config("tiny"), TINY)
    # 16 samples x 10 sampler steps; 16 x K=int(10 * 0.99)=9 pairs of v_old + forward + LoRA backward
    assert s.rollout == 16 * 10 * f.total
    assert s.train == 16 * 9 * (2 * f.total + f.linear + 2.5 * f.attention)
    assert s.total == pytest.approx(5.02e9, rel=1e-3)


@pytest.mark.parametrize("family, dims, side, msl", [("sd3", TINY_TRANSFORMER, 64, 16),
                                                     ("sd3", TINY_TRANSFORMER, 128, 32),
                                                     ("flux", TINY_FLUX_TRANSFORMER, 128, 32)])
def test_the_count_is_torchs_flop_count_within_3_percent(family, dims, side, msl):
    import diffusers
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from hpcnft.models.families import family_named

    d = DitDims.from_config(family, dims)
    image, text = image_tokens(d, side, side), text_tokens(family, msl)
    torch.manual_seed(0)
    dit = getattr(diffusers, family_named(family).transformer_class)(**dims)
    pe, pooled = torch.randn(1, text, dims["joint_attention_dim"]), torch.randn(1, dims["pooled_projection_dim"])
    if family == "sd3":
        args = dict(hidden_states=torch.randn(1, 16, side // 8, side // 8), timestep=torch.tensor([500.0]))
    else:
        args = dict(hidden_states=torch.randn(1, image, 64), timestep=torch.tensor([0.5]),
                    img_ids=torch.zeros(image, 3), txt_ids=torch.zeros(text, 3),
                    guidance=torch.tensor([3.5]) if dims.get("guidance_embeds") else None)
    # the math backend runs attention as matmuls, which the counter counts
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        dit(**args, encoder_hidden_states=pe, pooled_projections=pooled)
    assert dit_forward_flops(d, image, text).total == pytest.approx(counter.get_total_flops(), rel=0.03)


def test_qwen_images_count_is_torchs_flop_count_within_3_percent():
    """Qwen-Image's DiT takes packed 2x2 tokens (in_channels 64) and gives patch_size^2 x 16 back."""
    import torch
    from diffusers import QwenImageTransformer2DModel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from hpcnft.models.tiny_dims import TINY_QWEN_IMAGE_TRANSFORMER as dims

    d = DitDims.from_config("qwen_image", dims)
    image, text = image_tokens(d, 128, 128), text_tokens("qwen_image", 32)
    assert image == 64
    torch.manual_seed(0)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        QwenImageTransformer2DModel(**dims)(hidden_states=torch.randn(1, image, 64), timestep=torch.tensor([0.5]),
                                            encoder_hidden_states=torch.randn(1, text, dims["joint_attention_dim"]),
                                            img_shapes=[[(1, 8, 8)]])
    assert dit_forward_flops(d, image, text).total == pytest.approx(counter.get_total_flops(), rel=0.03)


def test_sd35m_train_pair_is_the_benchs_count():
    # docs/bench/README.md: SD3.5-M's fp16 train pair, 7.88 TFLOP counted (no gradient
    # checkpointing), 355 GFLOP of attention per forward
    from hpcnft.bench.shapes import sd35m_shapes

    d = DitDims.from_config("sd3", sd35m_shapes().dit)
    f = dit_forward_flops(d, image_tokens(d, 512, 512), text_tokens("sd3", 256))
    assert f.attention == pytest.approx(355e9, rel=2e-3)
    assert pair_flops(f, lora=True, forwards=2, backwards=1) == pytest.approx(7.88e12, rel=0.01)  # v_old + trained


def test_cfg_checkpointing_kl_and_full_fine_tune_add_their_passes():
    base = load_config("tiny")
    plain, f = step_flops(base, TINY), dit_forward_flops(TINY, 16, 93)
    assert step_flops(load_config("tiny", ["rollout.guidance_scale=4.5"]), TINY).rollout == 2 * plain.rollout
    pairs = 16 * 9
    checkpointing = load_config("tiny", ["train.grad_checkpointing=true"])
    assert step_flops(checkpointing, TINY).train == plain.train + pairs * f.total
    assert step_flops(load_config("tiny", ["nft.kl_beta=1e-4"]), TINY).train == plain.train + pairs * f.total
    assert step_flops(load_config("tiny", ["train.finetune=full"]), TINY).train == plain.train + pairs * f.linear
    flux = DitDims.from_config("flux", TINY_FLUX_TRANSFORMER)  # guidance-distilled: one pass whatever the scale
    assert step_flops(load_config("tiny_flux"), flux).rollout == 16 * 10 * dit_forward_flops(flux, 16, 16).total


def test_a_flow_grpo_pair_has_no_v_old_pass_and_its_trained_forward_takes_cfg_s_passes():
    nft, f = step_flops(load_config("tiny"), TINY), dit_forward_flops(TINY, 16, 93)
    pairs = 16 * 9
    grpo = load_config("tiny", ["algo.name=flow_grpo"])
    assert step_flops(grpo, TINY).train == nft.train - pairs * f.total  # v_old's forward gone
    guided = step_flops(load_config("tiny", ["algo.name=flow_grpo", "rollout.guidance_scale=4.5"]), TINY)
    assert guided.train == 2 * step_flops(grpo, TINY).train and guided.rollout == 2 * nft.rollout
    kl = load_config("tiny", ["algo.name=flow_grpo", "grpo.kl_beta=0.01"])
    assert step_flops(kl, TINY).train == step_flops(grpo, TINY).train + pairs * f.total


# -- the notes ------------------------------------------------------------------------------------
@pytest.fixture
def cpu(monkeypatch):
    monkeypatch.setattr(estimate, "runs_on_cpu", lambda cfg: True)
    monkeypatch.setattr(estimate, "available_cpus", lambda: 2)


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.setattr(estimate, "runs_on_cpu", lambda cfg: False)


def test_the_defaults_are_the_sd35m_pickscore_recipes_sizes_with_the_tiny_models():
    """What the note on a recipe file without base says it starts from."""
    defaults, recipe = flatten(Config().to_dict()), flatten(load_config("sd35m_pickscore").to_dict())
    differ = {k for k in defaults if defaults[k] != recipe[k]}
    assert differ == {"models.sd3_dir", "models.pickscore_dir", "models.pickscore_processor_dir", "data.train_prompts",
                      "data.eval_prompts", "train.grad_checkpointing", "layout.timeout_s"}


def test_a_recipe_file_with_only_steps_says_so_and_warns_on_a_cpu(tmp_path, cpu):
    p = str(tmp_path / "mine.toml")
    with open(p, "w") as f:
        f.write("steps = 2\n")
    note, warning = startup_notes(load_config(p), p)
    assert note == (f"recipe file {p!r} names no base: what it leaves unset takes the built-in defaults, the "
                    "sd35m_pickscore recipe's sizes (512x512, 8x8 samples a step, LoRA r32, fp16) with the tiny "
                    'models; add base = "tiny" to start from the tiny recipe')
    assert warning == ("warning: this config runs real-size shapes (512x512, 64 samples a step) on the tiny models "
                       "on a CPU: about 2 min a step (est. 2.1 TFLOP at 8 GFLOP/s x 2 threads); "
                       'did the recipe file mean base = "tiny"?')


def test_real_size_shapes_on_the_tiny_models_warn_on_a_gpu_too(gpu):
    (warning,) = startup_notes(load_config("tiny", ["rollout.height=512", "rollout.width=512"]), "tiny")
    assert warning.startswith("warning: this config runs real-size shapes (512x512, 16 samples a step) on the tiny "
                              "models; ") and "models.sd3_dir" in warning and "CPU" not in warning


@pytest.mark.parametrize("recipe", ["tiny", "tiny_learns", "tiny_flux", "tiny_qwen_image", "tiny_official",
                                    "tiny_multireward"])
def test_the_tiny_recipes_start_without_notes(recipe, cpu):
    assert startup_notes(load_config(recipe), recipe) == []


def test_a_recipe_file_from_tiny_gets_no_note(tmp_path, cpu):
    p = tmp_path / "mine.toml"
    p.write_text('base = "tiny"\nsteps = 2\n')
    assert startup_notes(load_config(str(p)), str(p)) == []


def test_a_real_model_on_a_cpu_warns_from_its_folders_config(tmp_path, cpu):
    from hpcnft.bench.shapes import sd35m_shapes

    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(sd35m_shapes().dit))
    (warning,) = startup_notes(load_config("sd35m_pickscore", [f'models.sd3_dir="{tmp_path}"']), "sd35m_pickscore")
    assert warning.startswith("warning: this config runs real-size shapes (512x512, 64 samples a step) on the SD3 "
                              "model on a CPU: about 5.4 days a step (est. 7.5 PFLOP at 8 GFLOP/s x 2 threads); "
                              "run it on a GPU, ")
    # a folder the preflight will refuse gives no estimate: its refusal is the line to read
    assert startup_notes(load_config("sd35m_pickscore", ['models.sd3_dir="/nonexistent"']), "sd35m_pickscore") == []
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(dict(sd35m_shapes().dit, num_layers="24")))
    assert startup_notes(load_config("sd35m_pickscore", [f'models.sd3_dir="{tmp_path}"']), "sd35m_pickscore") == []


def test_durations_and_flops_read_plainly():
    assert [estimate.seconds_text(s) for s in (59.4, 125, 7100, 7300, 50 * 3600)] == \
        ["59 s", "2 min", "118 min", "2.0 h", "2.1 days"]
    assert [estimate.flops_text(f) for f in (5e6, 2.04e12, 7.49e15)] == ["5.0 MFLOP", "2.0 TFLOP", "7.5 PFLOP"]


def test_the_threads_at_work_are_the_train_ranks_up_to_the_cpus():
    assert estimate.cpu_workers(train_ranks=2, threads=1, cpus=16) == 2
    assert estimate.cpu_workers(train_ranks=4, threads=2, cpus=2) == 2
    assert estimate.cpu_workers(train_ranks=1, threads=1, cpus=1) == 1


@pytest.mark.parametrize("launcher, rank, env, prints", [
    ("none", 0, {}, True),  # the local spawner
    ("none", 0, {"HPCNFT_LAUNCHER": "local"}, False),  # rank 0 of the spawner's ranks: printed already
    ("torchrun", 0, {}, True),
    ("torchrun", 1, {}, False),
    ("slurm", 0, {"HPCNFT_LAUNCHER": "submitit"}, True),
])
def test_the_notes_print_once_per_job(tmp_path, monkeypatch, capsys, cpu, launcher, rank, env, prints):
    monkeypatch.delenv("HPCNFT_LAUNCHER", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    p = tmp_path / "mine.toml"
    p.write_text("steps = 2\n")
    info = SimpleNamespace(launcher=launcher, rank=rank, world_size=3)
    estimate.print_startup_notes(load_config(str(p)), str(p), info)
    out, err = capsys.readouterr()
    assert (out.startswith("hpcnft: recipe file") and err.startswith("hpcnft: warning: ")) is prints
    assert (out, err) == ("", "") or prints


@pytest.mark.parametrize("family", ["sd3", "flux", "qwen_image"])
def test_the_text_tokens_are_each_familys_own(family):
    from hpcnft.models.families import family_named
    from hpcnft.run.estimate import text_tokens

    assert text_tokens(family, 256) == family_named(family).prompt_tokens(256)


@pytest.mark.parametrize("frames, side, msl", [(5, 64, 16), (9, 128, 32)])
def test_the_wan_count_is_torchs_flop_count_within_3_percent(frames, side, msl):
    """Wan's video DiT: self-attention over every latent frame's tokens, cross-attention to the
    text, its own feed-forward width."""
    import diffusers
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from hpcnft.models.tiny_dims import TINY_WAN_TRANSFORMER

    dims = dict(TINY_WAN_TRANSFORMER, num_attention_heads=4, attention_head_dim=24, ffn_dim=224)  # width 96
    d = DitDims.from_config("wan", dims)
    image, text = image_tokens(d, side, side, frames), text_tokens("wan", msl)
    assert image == ((frames - 1) // 4 + 1) * (side // 16) ** 2
    torch.manual_seed(0)
    dit = diffusers.WanTransformer3DModel(**dims)
    x = torch.randn(1, 16, (frames - 1) // 4 + 1, side // 8, side // 8)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        dit(hidden_states=x, timestep=torch.tensor([500.0]), encoder_hidden_states=torch.randn(1, text, 64))
    assert dit_forward_flops(d, image, text).total == pytest.approx(counter.get_total_flops(), rel=0.03)


def test_a_wan_step_counts_its_frames_and_both_cfg_passes():
    from hpcnft.models.tiny_dims import TINY_WAN_TRANSFORMER
    from hpcnft.run.estimate import dit_dims

    cfg, d = load_config("tiny_wan"), DitDims.from_config("wan", TINY_WAN_TRANSFORMER)
    f = dit_forward_flops(d, image_tokens(d, 64, 64, 5), 16)
    assert step_flops(cfg, d).rollout == 16 * 6 * 2 * f.total  # guidance 4.5: CFG's two passes
    assert dit_dims(cfg) == (d, True)
    longer = step_flops(load_config("tiny_wan", ["rollout.num_frames=9"]), d)
    assert longer.rollout > step_flops(cfg, d).rollout
