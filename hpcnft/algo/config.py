"""The sections every algorithm shares (each algorithm's own is in its folder, hpcnft.algo.registry):
`[algo]`, `[rollout]`, `[train]`, `[optim]`, `[ema]`, `[eval]`, with the vocabularies of their
choices (hpcnft.algo.solvers keys its samplers by SOLVERS). No torch: the config imports it."""
from __future__ import annotations

from dataclasses import dataclass

from hpcnft.algo.registry import ALGORITHMS
from hpcnft.common.config import setting
from hpcnft.common.errors import ConfigError
from hpcnft.distributed.reward_limits import MAX_CHUNK, MAX_CHUNK_BYTES, MAX_SIDE

SOLVERS = ("euler", "dpm2")  # rollout.solver: algo.solvers.SOLVERS has one sampler for each (a test holds them)
UINT8_ROUNDINGS = ("round", "truncate")
FINETUNES = ("lora", "full")
PRECISIONS = ("fp32", "fp16", "bf16")
EVAL_POLICIES = ("old", "ema")
ATTENTION_PROJECTIONS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                         "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"]


@dataclass
class AlgoConfig:
    name: str = setting("nft", "the RL algorithm (hpcnft/algo/registry.py); its own keys are in its section (DiffusionNFT: "
                               "`[nft]`, the old policy in `[ema]`; Flow-GRPO: `[grpo]`), and the keys only another "
                               "algorithm reads are refused", choices=tuple(ALGORITHMS))


@dataclass
class RolloutConfig:
    prompts_per_step: int = setting(8, "P, the prompts of a step", bound="> 0")
    samples_per_prompt: int = setting(8, "G, the samples of each prompt (one advantage group)", bound="> 0")
    num_steps: int = setting(10, "sampler steps (the ODE's; Flow-GRPO's SDE's)", bound="> 0")
    guidance_scale: float = setting(1.0, "guidance: SD3's and Wan's CFG when > 1 (1.0: none); FLUX's embedded "
                                          "guidance value")
    height: int = setting(512, "image height in pixels, a multiple of 16", bound="> 0", at_most=MAX_SIDE)
    width: int = setting(512, "image width in pixels, a multiple of 16", bound="> 0", at_most=MAX_SIDE)
    num_frames: int = setting(1, "video frames per sample (models.family=\"wan\": 1 + 4k, Wan2.1's VAE's 4x in "
                                 "time); 1: an image (the image families)", bound="> 0", at_most=1024)
    max_sequence_length: int = setting(256, "T5 tokens (FLUX: at most 512)", bound="> 0")
    batch_size: int = setting(8, "samples per DiT forward, and per chunk sent to the reward rank; at most the "
                                 "samples of a step", bound="> 0", at_most=MAX_CHUNK)
    seed: int = setting(42, "the rollout's noise seed")
    uint8_rounding: str = setting("round", "images to uint8: `round` (official) or `truncate` (miles)",
                                  choices=UINT8_ROUNDINGS)
    solver: str = setting("euler", "the rollout's ODE solver: `euler` (miles), or `dpm2`, DPM-Solver++ 2M, "
                                   "deterministic (official); the evaluation is always Euler", choices=SOLVERS)
    integer_timesteps: bool = setting(
        False, "while sampling (rollout and evaluation) the DiT gets long(1000σ), as the official pipeline, instead "
        "of the float 1000σ; training forwards keep the float")

    def check(self) -> None:
        for key in ("height", "width"):
            if getattr(self, key) % 16:
                raise ConfigError(f"rollout.{key}: must be a multiple of 16, got {getattr(self, key)}")
        # a chunk within what the reward service takes (its sides and count are the keys' own limits)
        if self.batch_size * self.num_frames * self.height * self.width * 3 > MAX_CHUNK_BYTES:
            what = f"videos of {self.num_frames} frames" if self.num_frames > 1 else "images"
            raise ConfigError(f"rollout.batch_size: a chunk of {self.batch_size} {what} of {self.height}x{self.width} "
                              f"is more than the reward service takes ({MAX_CHUNK_BYTES >> 20} MiB)")
        if self.batch_size * self.num_frames > MAX_CHUNK:  # each frame is an image to the terms
            raise ConfigError(f"rollout.batch_size: a chunk of {self.batch_size} videos of {self.num_frames} frames is "
                              f"{self.batch_size * self.num_frames} images for the reward terms, more than the "
                              f"{MAX_CHUNK} a chunk may hold")
        samples = self.prompts_per_step * self.samples_per_prompt
        if self.batch_size > samples:
            raise ConfigError(f"rollout.batch_size: {self.batch_size} is more than the {samples} samples of a step")


@dataclass
class TrainConfig:
    finetune: str = setting("lora", "what is trained: `lora` adapters or the `full` DiT", choices=FINETUNES)
    lora_rank: int = setting(32, "peft LoRA rank", bound="> 0")
    lora_alpha: int = setting(64, "peft LoRA alpha", bound="> 0")
    lora_targets: list[str] = setting(ATTENTION_PROJECTIONS, "the modules LoRA adapts (the attention projections)")
    micro_batch: int = setting(4, "(sample, σ) pairs per forward and backward", bound="> 0")
    precision: str = setting("fp16", "`fp32`, `fp16` (autocast and a grad scaler) or `bf16` (autocast)",
                             choices=PRECISIONS)
    grad_scaler_init: float = setting(65536.0, "fp16: the grad scaler's initial scale", bound="> 0")
    grad_checkpointing: bool = setting(False, "activation checkpointing of the DiT blocks")
    seed: int = setting(1234, "the train step's seeds: NFT's σ order and corruption noise, Flow-GRPO's split of the "
                              "samples into updates, LoRA init")

    def check(self) -> None:
        if not self.lora_targets and self.finetune == "lora":
            raise ConfigError("train.lora_targets: empty, LoRA would train nothing")


@dataclass
class OptimConfig:
    lr: float = setting(3e-4, "AdamW learning rate", bound="> 0")
    weight_decay: float = setting(1e-4, "AdamW weight decay", bound=">= 0")
    beta1: float = setting(0.9, "AdamW β1", bound="[0, 1]")
    beta2: float = setting(0.999, "AdamW β2", bound="[0, 1]")
    eps: float = setting(1e-8, "AdamW ε", bound=">= 0")
    grad_clip: float = setting(1.0, "gradient norm clip (inf: none)", bound="> 0", infinite=True)


@dataclass
class EMAConfig:
    ramp: float = setting(0.001, "old policy θ_old ← δ θ_old + (1 − δ) θ with δ = min(ramp · (k − flat_steps), "
                                 "max) after optimizer step k", bound=">= 0")
    max: float = setting(0.5, "the old policy's largest decay δ", bound=(">= 0", "[0, 1]"))
    flat_steps: int = setting(0, "steps of decay `ema.flat_decay` before the ramp", bound=">= 0")
    flat_decay: float = setting(0.0, "the old policy's decay for the first `ema.flat_steps` steps",
                                bound=(">= 0", "[0, 1]"))


@dataclass
class EvalConfig:
    every: int = setting(30, "evaluate every this many steps (0: no periodic evaluation; `eval.at_end` still "
                             "applies)", bound=">= 0")
    num_steps: int = setting(50, "Euler steps of the evaluation's sampler", bound="> 0")
    num_prompts: int = setting(0, "evaluation prompts (0: the whole eval prompt file)", bound=">= 0")
    seed: int = setting(42, "the evaluation's noise seed")
    at_end: bool = setting(True, "evaluate at the last step")
    at_start: bool = setting(False, "evaluate before the first step of a run (not on resume)")
    policy: str = setting("old", "the evaluated weights: `old` (π_old, the rollout policy) or `ema`, an EMA of θ of "
                                 "its own (official), checkpointed", choices=EVAL_POLICIES)
    ema_decay: float = setting(0.9, "`eval.policy = \"ema\"`: decay min((1 + k) / (10 + k), ema_decay) after "
                                    "optimizer step k", bound="[0, 1]")
    ema_update_every: int = setting(1, "`eval.policy = \"ema\"`: the EMA moves after optimizer step k only where k + 1 "
                                       "is a multiple of this (the official EMAModuleWrapper's update_step_interval; "
                                       "Flow-GRPO's recipes: 8)", bound="> 0")


GUARD_ACTIONS = ("warn", "stop")


@dataclass
class WatchConfig:
    """`[watch]`: signs of reward hacking seen during the run (hpcnft.algo.watch computes them,
    hpcnft.run.guard acts on them). Every key is off by default: a run without them writes the
    same rows as before."""
    diversity: bool = setting(False, "`rollout/diversity` every step: within each prompt's group, the mean "
                                     "pairwise distance of its images (RMS over 32x32 thumbnails, 0..1); collapse to "
                                     "one image drives it to 0", on_resume="free")
    drift_sigmas: list[float] = setting(
        [], "`eval/drift` at every evaluation: the mean squared difference between the evaluated policy's and the "
        "base model's velocity at these noise levels (0 < sigma <= 1), on the evaluation's images and noise (a full "
        "fine-tune keeps a copy of its base on the host for it); with LoRA also `eval/lora_norm`, the adapters' "
        "norm; empty: off", on_resume="free")
    guard_metric: str = setting("", "an evaluation metric to guard (a held-out judge: `eval/<term>_mean` of an "
                                    "`eval_only` term); empty: no guard", on_resume="free")
    guard_drop: float = setting(0.0, "the guard fires at an evaluation where `guard_metric` is more than this below "
                                     "its best while the trained reward (rollout/reward/raw_mean) is above its value "
                                     "at that best", bound=">= 0", on_resume="free")
    guard_action: str = setting("warn", "`warn`: a warning event and one line; `stop`: also checkpoint and stop "
                                        "the run (exit 0)", choices=GUARD_ACTIONS, on_resume="free")

    def check(self) -> None:
        for s in self.drift_sigmas:
            if not 0 < s <= 1:
                raise ConfigError(f"watch.drift_sigmas: {s} is not a noise level in (0, 1]")
        if self.guard_metric and not self.guard_metric.startswith("eval/"):
            raise ConfigError(f"watch.guard_metric: {self.guard_metric!r} is not an evaluation metric (eval/...)")
