"""--levers and --set: the standard single-lever sweep, KEY=VALUE parsing, the "hpcnft fast" overrides."""
from __future__ import annotations

from hpcnft.bench.shapes import Shapes
from hpcnft.common.errors import UsageError

LEVER_SWEEP = [
    {"perf.attention_backend": "flash"}, {"perf.attention_backend": "cudnn"},
    {"perf.skip_single_rank_fsdp": True}, {"perf.merge_lora_nograd": True}, {"perf.old_pass_batch": 16},
    {"rollout.batch_size": 32}, {"perf.vae_dtype": "fp16"}, {"perf.vae_channels_last": True},
    {"perf.pickscore_dtype": "fp16"}, {"train.grad_checkpointing": True},
    {"perf.compile_blocks": True, "perf.skip_single_rank_fsdp": True},
    {"perf.fuse_qkv": True, "perf.merge_lora_nograd": True, "perf.skip_single_rank_fsdp": True},
    {"perf.fused_lora": True, "perf.skip_single_rank_fsdp": True},
    {"perf.compile_vae": True}, {"perf.cudnn_benchmark": True},
]


def _parse_value(raw: str):
    import tomllib

    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def expand_levers(specs: list[str], dev, S: Shapes, flag: str = "--levers") -> list[dict]:
    """--levers (or --variant) items -> one dict of config overrides per measurement. An item is
    KEY=VALUE[,KEY=VALUE...], a KEY without a dot being a perf.* key, or, for --levers, 'all'
    (the standard sweep on top of hpcnft default)."""
    sweep = flag == "--levers"
    out = []
    for spec in specs or []:
        if spec == "all" and sweep:
            for lever in LEVER_SWEEP:
                lever = dict(lever)
                if dev.type != "cuda" and set(lever) & set(CUDA_ONLY_KEYS()):
                    continue
                if set(lever) & set(family_only_keys(S)):
                    continue
                if "rollout.batch_size" in lever:
                    lever["rollout.batch_size"] = 2 * max(S.rollout_batches)
                    if lever["rollout.batch_size"] > S.samples:
                        continue
                if "perf.old_pass_batch" in lever:
                    lever["perf.old_pass_batch"] = max(S.rollout_batches)
                out.append(lever)
            continue
        lever = {}
        for item in spec.split(","):
            if "=" not in item:
                raise UsageError(f"{flag} {spec!r}: expected KEY=VALUE[,KEY=VALUE...]"
                                 + (" or 'all'" if sweep else ""))
            k, raw = item.split("=", 1)
            k = k.strip()
            lever[k if "." in k else "perf." + k] = _parse_value(raw)
        out.append(lever)
    return out


def CUDA_ONLY_KEYS():  # noqa: N802 - a constant, read lazily so the CLI stays light
    from hpcnft.perf.levers import CUDA_ONLY

    return CUDA_ONLY


def family_only_keys(S: Shapes) -> tuple:
    """The perf keys the shapes' model family cannot take (validation.SD3_ONLY_LEVERS off SD3)."""
    from hpcnft.perf.config import SD3_ONLY_LEVERS

    return () if S.family == "sd3" else tuple(f"perf.{k}" for k in SD3_ONLY_LEVERS)


def fast_overrides(S: Shapes, dev, overrides: list[str]) -> dict:
    """"hpcnft fast": FAST, at the shapes' largest batch sizes but for sd35m (FAST's are its),
    with the shapes' gradient checkpointing, without the levers the family cannot take (FLUX:
    the SD3-only ones), on a CPU without the GPU-only ones; then --set."""
    from hpcnft.perf.levers import FAST

    out = dict(FAST)
    if S.name != "sd35m":  # FAST's batch sizes are for the SD3.5-M shapes
        out["rollout.batch_size"], out["train.micro_batch"] = max(S.rollout_batches), max(S.micro_batches)
        out["perf.old_pass_batch"] = max(S.rollout_batches)
    if S.grad_checkpointing:  # the shapes need it (memory), in every stack
        out["train.grad_checkpointing"] = True
    if S.precision == "bf16" and out.get("perf.vae_dtype") == "fp16":
        out["perf.vae_dtype"] = "bf16"  # the VAE in the DiT's dtype, as FluxPipeline (and the eager stack) run it
    for k in family_only_keys(S):
        out.pop(k, None)
    if dev.type != "cuda":  # compile and SDPA backends are measured on GPUs; half precision too
        for k in CUDA_ONLY_KEYS() + ("perf.vae_dtype", "perf.pickscore_dtype"):
            out.pop(k, None)
    for item in overrides or []:
        if "=" not in item:
            raise UsageError(f"--set {item!r}: expected KEY=VALUE")
        k, raw = item.split("=", 1)
        out[k.strip()] = _parse_value(raw)
    return out
