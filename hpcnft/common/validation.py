"""The config's rules: allowed choices and ranges per key, and the checks across keys."""
from __future__ import annotations

import math
import re

from hpcnft.common.errors import ConfigError

CHOICES = {
    "models.family": ("sd3", "flux"),
    "train.finetune": ("lora", "full"),
    "train.precision": ("fp32", "fp16", "bf16"),
    "nft.timestep_strategy": ("first", "random_per_sample", "drop_random"),
    "nft.group_by": ("position", "prompt"),
    "nft.adv_mode": ("all", "positive_only", "negative_only", "one_only", "binary"),
    "rollout.solver": ("euler", "dpm2"),
    "eval.policy": ("old", "ema"),
    "nft.std_estimator": ("unbiased", "population"),
    "layout.backend": ("auto", "gloo", "nccl"),
    "layout.device": ("auto", "cpu", "cuda"),
    "rollout.uint8_rounding": ("round", "truncate"),
    "perf.attention_backend": ("default", "flash", "cudnn", "efficient", "math"),
    "perf.pickscore_dtype": ("fp32", "fp16"),
    "perf.pickscore_preprocess": ("cpu", "device"),
    "perf.vae_dtype": ("auto", "fp32", "fp16", "bf16"),
}
POSITIVE = {"steps", "rollout.prompts_per_step", "rollout.samples_per_prompt", "rollout.num_steps",
            "rollout.height", "rollout.width", "rollout.max_sequence_length", "rollout.batch_size",
            "train.lora_rank", "train.lora_alpha", "train.micro_batch", "train.grad_scaler_init",
            "optim.lr", "optim.grad_clip", "layout.train_ranks", "layout.timeout_s", "eval.num_steps",
            "checkpoint.keep", "nft.beta", "nft.adv_clip_max", "determinism.cpu_threads"}
NON_NEGATIVE = {"optim.weight_decay", "optim.eps", "ema.ramp", "ema.max", "ema.flat_steps", "ema.flat_decay",
                "eval.every", "eval.num_prompts", "checkpoint.every", "layout.reward_ranks",
                "nft.kl_beta", "logging.sample_grid_every", "logging.sample_grid_images"}
MAY_BE_INFINITE = {"optim.grad_clip"}  # inf: no clipping
# Upper bounds: collectives wait at most a day; images and chunks within what the reward
# service accepts (reward_service.MAX_SIDE, MAX_CHUNK, MAX_CHUNK_BYTES).
AT_MOST = {"layout.timeout_s": 86400.0, "rollout.height": 8192, "rollout.width": 8192, "rollout.batch_size": 4096}
# Levers written for SD3's joint attention and blocks (perf.fused_qkv, perf.epilogue, perf.fp8)
SD3_ONLY_LEVERS = ("fuse_qkv", "fused_lora", "gelu_epilogue", "rollout_fp8", "v_old_fp8")
FLUX_MAX_SEQUENCE_LENGTH = 512  # FluxPipeline refuses more T5 tokens
TRACKERS = ("tensorboard", "wandb")  # logging.trackers: hpcnft/io/trackers.py has one class for each
# reward.terms: the kinds hpcnft/rewards/registry.py loads, and what each needs set
TERM_KINDS = ("pickscore", "hpsv2", "clipscore", "aesthetic", "jpeg_compressibility", "jpeg_incompressibility",
              "remote")
TERM_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")
# A remote term's token_env: the variable holding its shared secret. Only HPCNFT_ names, so that a
# recipe from elsewhere cannot send another secret of the environment (a cloud key) to its url.
REWARD_TOKEN_ENV = "HPCNFT_REWARD_TOKEN"
TOKEN_ENV = re.compile(r"HPCNFT_[A-Z0-9_]{1,100}")
MAX_CHUNK_BYTES = 1 << 30  # one chunk of uint8 images: 1 GiB (the recipe's 8 images of 512² are 6 MiB)
UNIT_INTERVAL = {"nft.timestep_fraction", "eval.ema_decay", "ema.max", "ema.flat_decay", "optim.beta1", "optim.beta2"}


def flatten(d: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def validate(cfg) -> None:
    """Refuse a config (ConfigError naming the key) that no run could use."""
    flat = flatten(cfg.to_dict())
    if cfg.layout.emulate_hosts and (cfg.layout.backend == "gloo" or cfg.layout.device == "cpu"):
        raise ConfigError("layout.emulate_hosts: lets NCCL ranks share a GPU; it cannot apply with "
                          f"layout.backend={cfg.layout.backend!r}, layout.device={cfg.layout.device!r}")
    for key, allowed in CHOICES.items():
        if flat[key] not in allowed:
            raise ConfigError(f"{key}: {flat[key]!r} is not one of {', '.join(allowed)}")
    for key in POSITIVE | NON_NEGATIVE | UNIT_INTERVAL:
        if isinstance(flat[key], float) and not math.isfinite(flat[key]) and key not in MAY_BE_INFINITE:
            raise ConfigError(f"{key}: must be a finite number, got {flat[key]!r}")
    for key in POSITIVE:
        if not flat[key] > 0:
            raise ConfigError(f"{key}: must be > 0, got {flat[key]!r}")
    for key in NON_NEGATIVE:
        if not flat[key] >= 0:
            raise ConfigError(f"{key}: must be >= 0, got {flat[key]!r}")
    for key in UNIT_INTERVAL:
        if not 0 <= flat[key] <= 1:
            raise ConfigError(f"{key}: must be within [0, 1], got {flat[key]!r}")
    for key, limit in AT_MOST.items():
        if not flat[key] <= limit:
            raise ConfigError(f"{key}: must be <= {limit:g}, got {flat[key]!r}")
    for key, value in flat.items():
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, str) and ("\0" in v or "\n" in v) for v in values):
            raise ConfigError(f"{key}: must not contain NUL or newline characters")
    for name in cfg.logging.trackers:
        if name not in TRACKERS:
            raise ConfigError(f"logging.trackers: {name!r} is not one of {', '.join(TRACKERS)}")
        if cfg.logging.trackers.count(name) > 1:
            raise ConfigError(f"logging.trackers: {name!r} is listed more than once")
    _validate_terms(cfg.reward.terms)
    if not re.fullmatch(r"0?[0-7]{3}", cfg.umask):
        raise ConfigError(f"umask: expected an octal mask such as \"077\" or \"027\", got {cfg.umask!r}")
    r = cfg.rollout
    for key in ("height", "width"):
        if getattr(r, key) % 16:
            raise ConfigError(f"rollout.{key}: must be a multiple of 16, got {getattr(r, key)}")
    if int(r.num_steps * cfg.nft.timestep_fraction) < 1:
        raise ConfigError("nft.timestep_fraction: trains no sigma at rollout.num_steps "
                          f"{r.num_steps} (needs num_steps * fraction >= 1)")
    if r.batch_size * r.height * r.width * 3 > MAX_CHUNK_BYTES:
        raise ConfigError(f"rollout.batch_size: a chunk of {r.batch_size} images of {r.height}x{r.width} is more "
                          f"than the reward service takes ({MAX_CHUNK_BYTES >> 20} MiB)")
    if r.batch_size > cfg.samples_per_step:
        raise ConfigError(f"rollout.batch_size: {r.batch_size} is more than the {cfg.samples_per_step} "
                          "samples of a step")
    if not cfg.train.lora_targets and cfg.train.finetune == "lora":
        raise ConfigError("train.lora_targets: empty, LoRA would train nothing")
    if cfg.perf.fused_lora and cfg.train.finetune != "lora":
        raise ConfigError("perf.fused_lora: needs train.finetune=\"lora\"")
    if cfg.models.family != "sd3":
        for lever in SD3_ONLY_LEVERS:
            if getattr(cfg.perf, lever):
                raise ConfigError(f"perf.{lever}: works on SD3's blocks only, not with models.family="
                                  f"{cfg.models.family!r}")
    if cfg.models.family == "flux" and cfg.perf.attention_backend == "cudnn":
        raise ConfigError("perf.attention_backend: cuDNN's attention backward fails at FLUX.1's shapes "
                          "(models.family=\"flux\"); use flash, efficient or default")
    if cfg.models.family == "flux" and r.max_sequence_length > FLUX_MAX_SEQUENCE_LENGTH:
        raise ConfigError(f"rollout.max_sequence_length: FLUX's T5 takes at most {FLUX_MAX_SEQUENCE_LENGTH} tokens, "
                          f"got {r.max_sequence_length}")
    if cfg.perf.fuse_qkv and cfg.train.finetune == "lora" and not cfg.perf.merge_lora_nograd:
        raise ConfigError("perf.fuse_qkv: with train.finetune=\"lora\" it needs perf.merge_lora_nograd=true "
                          "(the fused projections hold the merged weights)")


def local_world_size(cfg) -> int:
    """The ranks the local spawner starts: the layout's train and reward ranks; one process when
    a single train rank scores its own samples (colocated)."""
    layout = cfg.layout
    return 1 if layout.reward_ranks == 0 and layout.train_ranks == 1 else layout.train_ranks + layout.reward_ranks


def check_layout(cfg, world_size: int) -> None:
    """The checks that need the config and the world size only, made once before any rank loads
    a model (in the spawner, or by the ranks of a launcher, which every rank fails alike)."""
    reward_ranks = cfg.layout.reward_ranks if world_size > 1 else 0
    if reward_ranks >= world_size:
        raise ConfigError(f"layout.reward_ranks: {reward_ranks} leaves no train rank in a world of {world_size}")
    train_ranks = world_size - reward_ranks
    if cfg.samples_per_step % train_ranks:
        raise ConfigError(f"rollout: {cfg.samples_per_step} samples per step do not split evenly over "
                          f"{train_ranks} train ranks (prompts_per_step x samples_per_prompt must be a multiple "
                          f"of the train ranks)")


def _validate_terms(terms) -> None:
    names = []
    for i, t in enumerate(terms):
        key = f"reward.terms[{i}]"
        if t.kind not in TERM_KINDS:
            raise ConfigError(f"{key}.kind: {t.kind!r} is not one of {', '.join(TERM_KINDS)}")
        name = t.name or t.kind
        if not TERM_NAME.fullmatch(name):
            raise ConfigError(f"{key}.name: {name!r} must be lower-case letters, digits and _ (a metric name)")
        if name in names:
            raise ConfigError(f"{key}.name: {name!r} names two terms (give each its own name)")
        names.append(name)
        if not math.isfinite(t.weight):
            raise ConfigError(f"{key}.weight: must be a finite number, got {t.weight!r}")
        if not (math.isfinite(t.timeout_s) and t.timeout_s > 0):
            raise ConfigError(f"{key}.timeout_s: must be > 0, got {t.timeout_s!r}")
        if t.retries < 0:
            raise ConfigError(f"{key}.retries: must be >= 0, got {t.retries!r}")
        if t.token_env and not TOKEN_ENV.fullmatch(t.token_env):
            raise ConfigError(f"{key}.token_env: {t.token_env!r} must name an environment variable HPCNFT_... "
                              "(upper-case letters, digits and _), or be \"\" to send no token")
        if t.kind == "remote" and not re.match(r"https?://", t.url):
            raise ConfigError(f"{key}.url: a remote term needs an http:// or https:// URL, got {t.url!r}")
    if terms and all(t.eval_only for t in terms):
        raise ConfigError("reward.terms: every term is eval_only, nothing would be trained on")
