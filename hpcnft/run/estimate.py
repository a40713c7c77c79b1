"""What `hpcnft run` says once the config has loaded, before anything is built: which values a
recipe file without `base` starts from, and a warning when a step will be long (real-size shapes
on the tiny models, or a CPU), with the time a step takes estimated from a count of its FLOPs.

The count is the DiT's: its passes are nearly all of a step's work (the VAE decodes each sample
once, against ~46 DiT passes a sample at the recipes' 10 steps). Per forward of one sample:
2 x (the weights a token passes through) x tokens for the linear layers, and 4 x tokens^2 x width
for each attention (QK^T and AV), with tokens = image tokens + text tokens. The functions below
are pure; `startup_notes` gathers what they need (the DiT's dimensions, the device)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from hpcnft.algo.registry import spec_of
from hpcnft.algo.root_config import Config
from hpcnft.common.recipe_files import is_recipe_file, recipe_file_base

VAE_FACTOR = 8  # pixels per latent cell, each side: both families' VAEs (4 blocks, 3 downsamplings)
FLUX_PACK = 2  # FLUX's DiT takes 2x2 latent cells as one token
# CPU FLOP/s of one thread on the DiT's passes, by this count. Measured on one thread of an AMD
# EPYC (torch 2.13), the tiny DiT's passes as the trainer runs them (LoRA, autocast) at 64x64 and
# 512x512: 7-12 GFLOP/s in fp32 and fp16, ~20 in bf16; a 1-step run of the defaults on the tiny
# models took 3.9x the rollout's time to train, this count says 3.6x. A large fp32 matmul does
# ~100 GFLOP/s there and an fp16 one 1-4 (no native fp16 GEMM): the tiny DiT's width of 32 and
# heads of 8 keep it far from a matmul's rate, so a matmul probe would promise a step 5-10x too
# short in the case this warning is for (real-size shapes on the tiny models). A real-size DiT's
# step on a CPU is hours at any of these rates.
CPU_FLOPS_PER_THREAD = 8e9
CPU_WARN_S = 60.0  # warn when a step on a CPU is estimated longer than this
# From this many pixels an image is real-size (the real recipes: 512x512; the tiny one: 64x64):
# the tiny models are random weights, built to run the job's code paths at small sizes.
REAL_SIZE_PIXELS = 256 * 256


@dataclass(frozen=True)
class DitDims:
    """What the FLOP count needs of a DiT's config (diffusers' SD3Transformer2DModel or
    FluxTransformer2DModel config.json keys; QwenImageTransformer2DModel's, WanTransformer3DModel's)."""
    family: str  # "sd3", "flux", "qwen_image" or "wan"
    width: int  # num_attention_heads * attention_head_dim
    layers: int  # SD3: MMDiT blocks; FLUX: double-stream blocks
    single_layers: int  # FLUX's single-stream blocks (SD3: 0)
    dual_layers: int  # SD3.5's blocks with a second, image-only attention
    patch: int
    in_channels: int
    out_channels: int
    joint_dim: int  # the text embeddings' width
    ffn: int = 0  # Wan's feed-forward width (SD3's and FLUX's: 4x the width)

    def __post_init__(self):
        sizes = (self.width, self.layers, self.single_layers, self.dual_layers, self.patch, self.in_channels,
                 self.out_channels, self.joint_dim, self.ffn)
        if not all(type(v) is int and v >= 0 for v in sizes):
            raise ValueError(f"not a DiT's dimensions: {self}")

    @classmethod
    def from_config(cls, family: str, c: dict) -> DitDims:
        if family == "wan":  # patches of (1, 2, 2): one latent frame deep
            return cls(family=family, width=c["num_attention_heads"] * c["attention_head_dim"],
                       layers=c["num_layers"], single_layers=0, dual_layers=0, patch=c["patch_size"][-1],
                       in_channels=c["in_channels"], out_channels=c.get("out_channels") or c["in_channels"],
                       joint_dim=c["text_dim"], ffn=c["ffn_dim"])
        if family == "qwen_image":  # packed tokens in (in_channels), patch_size^2 * out_channels out
            c = dict(c, patch_size=1, out_channels=c["patch_size"] ** 2 * (c.get("out_channels") or 16))
        return cls(family=family, width=c["num_attention_heads"] * c["attention_head_dim"], layers=c["num_layers"],
                   single_layers=c.get("num_single_layers", 0) if family == "flux" else 0,
                   dual_layers=len(c.get("dual_attention_layers") or ()), patch=c["patch_size"],
                   in_channels=c["in_channels"], out_channels=c.get("out_channels") or c["in_channels"],
                   joint_dim=c["joint_attention_dim"])


CLIP_TOKENS = 77


def text_tokens(family: str, max_sequence_length: int) -> int:
    """The DiT's text tokens: SD3's CLIP-L/G (77) beside T5, FLUX's T5 alone: each family's
    prompt_tokens (models.families, which imports torch, which the spawner does not)."""
    return max_sequence_length + (CLIP_TOKENS if family == "sd3" else 0)


def image_tokens(d: DitDims, height: int, width: int, frames: int = 1) -> int:
    """The DiT's image tokens; a video's (Wan's) are those of each latent frame, (frames - 1)/4 + 1."""
    side = VAE_FACTOR * d.patch * (FLUX_PACK if d.family in ("flux", "qwen_image") else 1)
    latent_frames = (frames - 1) // 4 + 1 if d.family == "wan" else 1
    return latent_frames * (height // side) * (width // side)


@dataclass(frozen=True)
class ForwardFlops:
    """One DiT forward of one sample: the linear layers' FLOPs and the attentions'."""
    linear: float
    attention: float

    @property
    def total(self) -> float:
        return self.linear + self.attention

    def backward(self, lora: bool) -> float:
        """Its backward: the linear layers' input gradients (1x), with their weight gradients (2x)
        for a full fine-tune; LoRA's frozen weights need none (the adapters' rank is small
        against the width, left out). Attention's backward at 2.5 forwards (docs/bench)."""
        return self.linear * (1 if lora else 2) + 2.5 * self.attention


def dit_forward_flops(d: DitDims, image: int, text: int) -> ForwardFlops:
    """FLOPs of one DiT forward of one sample with `image` and `text` tokens. A block's stream
    passes each of its tokens through 12 w^2 weights: q, k, v and out (4 w^2) and the 4x-wide
    feed-forward (8 w^2); FLUX's single-stream block too (qkv 3, MLP in 4, out 5). SD3's last
    block keeps only the text's q, k, v. Per-sample work (time and pooled embeddings, the adaLN
    modulations) is a few tokens' worth and left out."""
    w, joint = d.width, image + text
    linear = 2 * image * d.in_channels * d.patch ** 2 * w  # patch embedding
    linear += 2 * text * d.joint_dim * w  # text embedding
    linear += 2 * image * w * d.patch ** 2 * d.out_channels  # output projection
    if d.family == "wan":  # self-attention (4 w^2), cross-attention's q and out (2 w^2) and the
        # feed-forward (2 w ffn) on the image tokens, its k and v on the text; the text embedding's second layer
        linear += 2 * text * w * w + d.layers * (2 * image * (6 * w * w + 2 * w * d.ffn) + 2 * text * 2 * w * w)
        attention = d.layers * (4 * image ** 2 * w + 4 * image * text * w)
    elif d.family == "sd3":
        linear += d.layers * 2 * 12 * w * w * image + (d.layers - 1) * 2 * 12 * w * w * text
        linear += 2 * 3 * w * w * text  # the last block: the text's q, k, v only
        linear += d.dual_layers * 2 * 4 * w * w * image  # the image-only attention's projections
        attention = d.layers * 4 * joint ** 2 * w + d.dual_layers * 4 * image ** 2 * w
    else:
        linear += (d.layers + d.single_layers) * 2 * 12 * w * w * joint
        attention = (d.layers + d.single_layers) * 4 * joint ** 2 * w
    return ForwardFlops(float(linear), float(attention))


@dataclass(frozen=True)
class StepFlops:
    forward: ForwardFlops  # one DiT forward of one sample
    rollout: float  # every sample's sampler steps (both CFG passes)
    train: float  # every pair: v_old, the trained forward and backward, the KL reference

    @property
    def total(self) -> float:
        return self.rollout + self.train


def step_flops(cfg: Config, d: DitDims) -> StepFlops:
    """The DiT FLOPs of one iteration, all train ranks together (hpcnft.algo.iteration: the rollout
    samples, then the train step's pairs, K trained sigmas or transitions a sample)."""
    r, t = cfg.rollout, cfg.train
    f = dit_forward_flops(d, image_tokens(d, r.height, r.width, r.num_frames),
                          text_tokens(d.family, r.max_sequence_length))
    # SD3's and Wan's CFG: two passes; FLUX embeds its guidance
    passes = 2 if d.family in ("sd3", "wan") and r.guidance_scale > 1.0 else 1
    rollout = cfg.samples_per_step * r.num_steps * passes * f.total
    pairs = cfg.samples_per_step * cfg.trained_steps  # the algorithm's K a sample
    forwards, backwards = spec_of(cfg.algo.name).pair_passes(cfg, passes)
    return StepFlops(f, rollout, pairs * pair_flops(f, t.finetune == "lora", forwards, backwards))


def pair_flops(f: ForwardFlops, lora: bool, forwards: int, backwards: int) -> float:
    """One train pair of `forwards` DiT forwards and `backwards` backwards (the algorithm's count,
    hpcnft.algo.spec: pair_passes)."""
    return forwards * f.total + backwards * f.backward(lora)


def cpu_step_seconds(flops: float, workers: int, rate: float = CPU_FLOPS_PER_THREAD) -> float:
    return flops / (rate * max(workers, 1))


def cpu_workers(train_ranks: int, threads: int, cpus: int) -> int:
    """Threads at work on the DiT at once: each train rank's, up to the CPUs there are."""
    return max(1, min(train_ranks * threads, cpus))


def seconds_text(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    if s < 48 * 3600:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


def flops_text(f: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if f >= scale:
            return f"{f / scale:.1f} {unit}"
    return f"{f / 1e6:.1f} MFLOP"


def base_note(recipe: str, base: str | None) -> str | None:
    """What a recipe file without `base` starts from: the dataclasses' defaults, which are the
    sd35m_pickscore recipe's sizes and hyperparameters with the tiny models and prompts (a test
    holds the two together)."""
    if not is_recipe_file(recipe) or base is not None:
        return None
    c = Config()
    r, t = c.rollout, c.train
    return (f"recipe file {recipe!r} names no base: what it leaves unset takes the built-in defaults, the "
            f"sd35m_pickscore recipe's sizes ({r.height}x{r.width}, {r.prompts_per_step}x{r.samples_per_prompt} "
            f"samples a step, LoRA r{t.lora_rank}, {t.precision}) with the tiny models; "
            f'add base = "tiny" to start from the tiny recipe')


def step_warning(cfg: Config, flops: StepFlops, *, tiny: bool, on_cpu: bool, workers: int,
                 no_base: bool) -> str | None:
    """One warning line, or None: real-size shapes on the tiny models, or a step on a CPU
    estimated longer than CPU_WARN_S. `tiny`: the DiT is the tiny model; `no_base`: the config
    came from a recipe file without `base`."""
    r = cfg.rollout
    real = r.height * r.width >= REAL_SIZE_PIXELS
    seconds = cpu_step_seconds(flops.total, workers)
    if not (tiny and real) and not (on_cpu and seconds > CPU_WARN_S):
        return None
    shapes = f"{'real-size shapes' if real else 'shapes'} ({r.height}x{r.width}, {cfg.samples_per_step} samples a step)"
    models = "the tiny models" if tiny else f"the {cfg.models.family.upper()} model"
    where = ""
    if on_cpu:
        where = (f" on a CPU: about {seconds_text(seconds)} a step (est. {flops_text(flops.total)} at "
                 f"{CPU_FLOPS_PER_THREAD / 1e9:.0f} GFLOP/s x {workers} thread{'s' if workers > 1 else ''})")
    if tiny and real and no_base:
        hint = 'did the recipe file mean base = "tiny"?'
    elif tiny and real:
        hint = (f"the tiny models are random weights for the tiny recipe's 64x64: set models.{cfg.models.family}_dir "
                f"to a model folder, or use smaller rollout.height/width")
    else:
        hint = "run it on a GPU, or lower rollout.height/width and rollout.prompts_per_step/samples_per_prompt"
    return f"warning: this config runs {shapes} on {models}{where}; {hint}"


# -- what the notes read off the machine and the model folders --------------------------------
def dit_dims(cfg: Config) -> tuple[DitDims | None, bool]:
    """(the DiT's dimensions or None where its config cannot be read, whether it is the tiny model)."""
    from hpcnft.models.tiny_cache import base_dir

    m = cfg.models
    folder = base_dir(m)
    if not folder:
        from hpcnft.models.tiny_dims import (TINY_FLUX_TRANSFORMER, TINY_QWEN_IMAGE_TRANSFORMER, TINY_TRANSFORMER,
                                             TINY_WAN_TRANSFORMER)

        tiny = {"sd3": TINY_TRANSFORMER, "flux": TINY_FLUX_TRANSFORMER, "qwen_image": TINY_QWEN_IMAGE_TRANSFORMER,
                "wan": TINY_WAN_TRANSFORMER}[m.family]
        return DitDims.from_config(m.family, tiny), True
    try:  # a folder the preflight will refuse gives no estimate (its refusal is the line to see)
        with open(os.path.join(folder, "transformer", "config.json"), encoding="utf-8") as f:
            return DitDims.from_config(m.family, json.load(f)), False
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # not such a config
        return None, False


def runs_on_cpu(cfg: Config) -> bool:
    """Whether the ranks will run on CPUs. For layout.device auto, whether this machine shows
    no NVIDIA GPU to this process (the driver's device list, CUDA_VISIBLE_DEVICES): the spawner
    imports no torch to ask it, and the answer only words a warning."""
    if cfg.layout.device != "auto":
        return cfg.layout.device == "cpu"
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return True
    try:
        return not os.listdir("/proc/driver/nvidia/gpus")
    except OSError:
        return True


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def startup_notes(cfg: Config, recipe: str, train_ranks: int | None = None) -> list[str]:
    """The lines `hpcnft run` prints before it starts (none for a plain start of a built-in recipe)."""
    base = recipe_file_base(recipe)
    notes = [n for n in [base_note(recipe, base)] if n]
    dims, tiny = dit_dims(cfg)
    if dims is None:
        return notes
    workers = cpu_workers(train_ranks or cfg.layout.train_ranks, cfg.determinism.cpu_threads, available_cpus())
    line = step_warning(cfg, step_flops(cfg, dims), tiny=tiny, on_cpu=runs_on_cpu(cfg), workers=workers,
                        no_base=is_recipe_file(recipe) and base is None)
    return notes + ([line] if line else [])


def print_startup_notes(cfg: Config, recipe: str, info) -> None:
    """Print the notes once per job: in the local spawner, else on rank 0 of a launcher's ranks
    (not in the ranks the local spawner starts: it printed them already). The warning goes to
    stderr, the note on the recipe's base to stdout."""
    import sys

    spawned = os.environ.get("HPCNFT_LAUNCHER") == "local"
    spawner = info.launcher == "none" and not os.environ.get("HPCNFT_LAUNCHER")
    if not spawner and (spawned or info.rank != 0):
        return
    train_ranks = None if spawner else max(1, info.world_size - cfg.layout.reward_ranks)
    for line in startup_notes(cfg, recipe, train_ranks):
        print(f"hpcnft: {line}", file=sys.stderr if line.startswith("warning:") else sys.stdout, flush=True)
