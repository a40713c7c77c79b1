"""The config: a dataclass tree, TOML recipes and `--set key=value` overrides, validated.

A recipe (read by hpcnft.common.recipe_files) is a TOML file whose tables mirror the dataclasses
below (`[optim] lr = 3e-4`).
`--set optim.lr=1e-3` overrides one value; the value is read as a TOML literal, so
`--set layout.train_ranks=1`, `--set train.finetune="full"` and `--set train.finetune=full` work.
Unknown keys, wrong types and out-of-range values are refused with a message naming the key.
"""
from __future__ import annotations

import dataclasses
import json
import tomllib
import typing
from dataclasses import dataclass, field

from hpcnft.common.errors import ConfigError
# recipe_names stays importable from here (hpcnft run's help lists the built-in recipes)
from hpcnft.common.recipe_files import read_recipe, recipe_names  # noqa: F401
from hpcnft.common.validation import REWARD_TOKEN_ENV, validate


@dataclass
class ModelsConfig:
    # The base model: "sd3" (SD3.5-M/-L, sd3_dir) or "flux" (FLUX.1-dev, flux_dir). An empty
    # folder means the tiny model, built into tiny_cache on first use.
    family: str = "sd3"
    sd3_dir: str = ""
    flux_dir: str = ""
    pickscore_dir: str = ""
    pickscore_processor_dir: str = ""  # defaults to pickscore_dir
    tiny_cache: str = ""  # defaults to $HPCNFT_CACHE/tiny-models or ~/.cache/hpcnft/tiny-models


@dataclass
class DataConfig:
    train_prompts: str = "builtin:tiny_train_prompts.txt"
    eval_prompts: str = "builtin:tiny_eval_prompts.txt"
    shuffle: bool = False  # seeded shuffle per pass over the file (recipe: file order)


@dataclass
class RolloutConfig:
    prompts_per_step: int = 8  # P
    samples_per_prompt: int = 8  # G
    num_steps: int = 10
    guidance_scale: float = 1.0  # 1.0 = no CFG
    height: int = 512
    width: int = 512
    max_sequence_length: int = 256  # T5 tokens
    batch_size: int = 8  # samples per DiT forward; also the chunk sent to the reward rank
    seed: int = 42
    uint8_rounding: str = "round"  # "round" (official) or "truncate" (miles)
    solver: str = "euler"  # "euler" (miles) or "dpm2": DPM-Solver++ 2M, deterministic (official)
    # The DiT's timestep input while sampling (rollout and evaluation): long(1000 sigma), the
    # official pipeline's, instead of the float 1000 sigma. Training forwards keep the float.
    integer_timesteps: bool = False


@dataclass
class RewardTermConfig:
    """One reward term (`[[reward.terms]]` in a recipe). Its settings by kind: model_dir (a model
    folder; empty = the term's tiny model), processor_dir, weights (a checkpoint file the kind
    needs beside its folder), url, timeout_s, retries and token_env (remote)."""
    kind: str = "pickscore"
    name: str = ""  # the metric name (rollout/reward/<name>/*, eval/<name>_*); defaults to kind
    weight: float = 1.0
    eval_only: bool = False  # scored at evaluation only, not part of the training reward
    model_dir: str = ""
    processor_dir: str = ""
    weights: str = ""
    url: str = ""
    timeout_s: float = 60.0
    retries: int = 2
    token_env: str = REWARD_TOKEN_ENV  # the environment variable holding the server's shared secret; "": none


@dataclass
class RewardConfig:
    # The training reward is scale * sum of weight * term over the training terms; -1 turns the
    # run into a control that should lower it. eval/<term>_* always report the plain term.
    scale: float = 1.0
    # Empty: PickScore alone, from models.pickscore_dir (the terms are then exactly today's).
    terms: list[RewardTermConfig] = field(default_factory=list)


@dataclass
class NFTConfig:
    beta: float = 1.0
    adv_clip_max: float = 5.0
    timestep_fraction: float = 0.99
    # "first" K sigmas (miles) or "random_per_sample": K of the T drawn per sample (official;
    # "drop_random" is its older name, the same draws)
    timestep_strategy: str = "first"
    shuffle_timesteps: bool = True
    adaptive_weight: bool = True
    std_estimator: str = "unbiased"  # "unbiased" (miles, N-1) or "population" (official, N)
    kl_beta: float = 0.0  # official: 1e-4 against the frozen base model
    group_by: str = "position"  # advantage groups: "position" (G consecutive samples) or "prompt" (its text)
    # "all" (miles), or the official variants applied to the clipped advantage: "positive_only",
    # "negative_only", "one_only" (1 where A > 0, else 0), "binary" (sign of A)
    adv_mode: str = "all"


@dataclass
class TrainConfig:
    finetune: str = "lora"  # "lora" or "full"
    lora_rank: int = 32
    lora_alpha: int = 64
    lora_targets: list[str] = field(default_factory=lambda: [
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
        "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"])
    micro_batch: int = 4  # (sample, sigma) pairs per forward/backward
    precision: str = "fp16"  # "fp32", "fp16" (autocast + grad scaler) or "bf16" (autocast)
    grad_scaler_init: float = 65536.0
    grad_checkpointing: bool = False
    seed: int = 1234  # NFT seeds (sigma shuffle, corruption noise, LoRA init)


@dataclass
class OptimConfig:
    lr: float = 3e-4
    weight_decay: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0


@dataclass
class EMAConfig:
    # old policy: theta_old <- d*theta_old + (1-d)*theta, d = min(ramp*k, max) after k>flat steps
    ramp: float = 0.001
    max: float = 0.5
    flat_steps: int = 0
    flat_decay: float = 0.0


@dataclass
class EvalConfig:
    every: int = 30  # 0 disables periodic eval (the end-of-run eval still runs when enabled)
    num_steps: int = 50
    num_prompts: int = 0  # 0 = the whole eval prompt file
    seed: int = 42
    at_end: bool = True
    at_start: bool = False
    policy: str = "old"  # evaluate "old" (pi_old, the rollout policy) or "ema": a separate EMA of theta (official)
    ema_decay: float = 0.9  # eval.policy="ema": decay min((1 + k) / (10 + k), ema_decay) after optimizer step k


@dataclass
class CheckpointConfig:
    every: int = 20
    keep: int = 2
    at_end: bool = True


@dataclass
class LayoutConfig:
    train_ranks: int = 2  # used by the local spawner; under a launcher the world size decides
    reward_ranks: int = 1  # 0 = reward scored in the training process (colocated)
    backend: str = "auto"  # "auto" (nccl on GPUs, gloo on CPUs), "gloo", "nccl"
    device: str = "auto"  # "auto", "cpu" or "cuda"
    timeout_s: float = 600.0  # collectives and reward traffic
    # Several NCCL ranks on one GPU, each claiming a host of its own (NCCL_HOSTID) so that NCCL
    # accepts them: to try a layout's code paths on one GPU. For correctness, not speed (the
    # ranks then talk over sockets).
    emulate_hosts: bool = False


@dataclass
class DeterminismConfig:
    enabled: bool = True
    cpu_threads: int = 1  # fixed per rank: CPU conv reductions depend on the thread count


@dataclass
class PreemptConfig:
    signal: str = "SIGUSR2"
    handle_sigterm: bool = True
    requeue: bool = True  # under Slurm, rank 0 runs `scontrol requeue $SLURM_JOB_ID`


@dataclass
class LoggingConfig:
    sample_grid_every: int = 10  # 0 disables the PNG grid of rollout images
    sample_grid_images: int = 16
    # Live trackers rank 0 feeds as the run goes ("tensorboard", "wandb"; optional extras):
    # every metrics row and every sample grid. run.h5 stays the record; a failing tracker is dropped.
    trackers: list[str] = field(default_factory=list)


@dataclass
class PerfConfig:
    """Speed levers (hpcnft bench measures each; all off by default). None changes the NFT math;
    some change rounding, and deterministic mode turns some off: see hpcnft/perf/levers.py."""
    attention_backend: str = "default"  # "default", "flash", "cudnn", "efficient", "math"
    compile_blocks: bool = False  # regional torch.compile of each DiT block
    vae_channels_last: bool = False
    vae_dtype: str = "auto"  # "auto" (as loaded), "fp32", "fp16" or "bf16"
    pickscore_dtype: str = "fp32"  # "fp32" or "fp16"
    pickscore_preprocess: str = "cpu"  # "cpu" (the processor, PIL) or "device" (tensor ops on the scorer's device)
    skip_single_rank_fsdp: bool = False  # one-rank train mesh: plain module, no FSDP2 wrapping
    merge_lora_nograd: bool = False  # rollout and v_old on W + s*B@A merged into the base weights
    old_pass_batch: int = 0  # v_old for all of a step's pairs in passes of this size (0: per micro-batch)
    fuse_qkv: bool = False  # no-grad passes on merged weights: q, k, v (and the context's) from one GEMM
    fused_lora: bool = False  # trained forward: q, k, v from one base GEMM and one LoRA-A GEMM per stream
    overlap_reward: bool = False  # world 1: PickScore in a worker thread while the next chunk samples
    compile_vae: bool = False  # torch.compile of the VAE decoder (GPU)
    cudnn_benchmark: bool = False  # cuDNN picks convolution algorithms by timing (VAE)
    inductor_tuning: bool = False  # Inductor times block sizes of its Triton kernels (compile_blocks, compile_vae)
    inductor_autotune: bool = False  # Inductor times a wider set of Triton configs, compiled in parallel
    gelu_epilogue: bool = False  # no-grad passes: feed-forward linear + tanh GELU as one GEMM (cuBLASLt epilogue)
    rollout_fp8: bool = False  # the rollout's DiT blocks multiply in fp8 (e4m3, row-wise scales)
    v_old_fp8: bool = False  # the train step's v_old pass multiplies in fp8 too (the NFT loss's old velocity)


@dataclass
class Config:
    steps: int = 100
    run_dir: str = ""
    umask: str = "077"  # octal file-creation mask of every rank: run dir, run.h5, logs, checkpoints
    models: ModelsConfig = field(default_factory=ModelsConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    nft: NFTConfig = field(default_factory=NFTConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    determinism: DeterminismConfig = field(default_factory=DeterminismConfig)
    preempt: PreemptConfig = field(default_factory=PreemptConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    perf: PerfConfig = field(default_factory=PerfConfig)

    # -- derived ----------------------------------------------------------------------
    @property
    def samples_per_step(self) -> int:
        return self.rollout.prompts_per_step * self.rollout.samples_per_prompt

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _type_of(cls, name: str):
    return typing.get_type_hints(cls)[name]


def _coerce(key: str, value, typ):
    """Check `value` against the annotated type; ints are accepted where floats are expected."""
    origin = typing.get_origin(typ)
    if dataclasses.is_dataclass(typ):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table of settings, got {value!r}")
        item = typ()
        _apply(item, value, key + ".")
        return item
    if origin is list:
        (item,) = typing.get_args(typ)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(key, v, item) for v in value]
    if typ is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if typ is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {typ}")


def _apply(obj, data: dict, prefix: str = "") -> None:
    fields = _fields(type(obj))
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in fields:
            raise ConfigError(f"unknown config key {key!r}" + _suggest(name, fields))
        current = getattr(obj, name)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: is a table of settings, not a value")
            _apply(current, value, key + ".")
        else:
            setattr(obj, name, _coerce(key, value, _type_of(type(obj), name)))


def _suggest(name: str, fields) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(fields), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def parse_set(item: str) -> tuple[str, object]:
    """`a.b=value` -> ("a.b", parsed value); the value is a TOML literal, or a bare string."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key, value


def _nest(key: str, value) -> dict:
    out: dict = {}
    cur = out
    parts = key.split(".")
    for p in parts[:-1]:
        cur = cur.setdefault(p, {})
    cur[parts[-1]] = value
    return out


def load_config(recipe: str = "tiny", overrides: list[str] | None = None, *, steps: int | None = None,
                run_dir: str | None = None) -> Config:
    cfg = Config()
    _, table = read_recipe(recipe)
    _apply(cfg, table)
    for item in overrides or []:
        key, value = parse_set(item)
        _apply(cfg, _nest(key, value))
    if steps is not None:
        _apply(cfg, {"steps": steps})
    if run_dir is not None:
        cfg.run_dir = run_dir
    validate(cfg)
    return cfg


def config_from_dict(data: dict) -> Config:
    cfg = Config()
    _apply(cfg, data)
    validate(cfg)
    return cfg
