"""`hpcnft export RUN [--step K] [--policy trained|old] OUT`: the weights of a checkpoint as a
folder diffusers loads directly: LoRA adapters as `pytorch_lora_weights.safetensors`
(`pipe.load_lora_weights(OUT)` on the run's StableDiffusion3Pipeline or FluxPipeline), or, for a
full fine-tune, a transformer folder (`SD3Transformer2DModel.from_pretrained(OUT)`,
`FluxTransformer2DModel.from_pretrained(OUT)`).

Runs in one process without a process group: DCP reassembles the sharded checkpoint."""
from __future__ import annotations

import os
import warnings

from hpcnft.common.errors import UsageError

POLICIES = {"trained": "model", "old": "old_policy"}


def add_arguments(name: str, p) -> None:
    p.add_argument("run", help="a run dir (or its run.h5)")
    p.add_argument("out", help="output folder")
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest complete one)")
    p.add_argument("--policy", choices=sorted(POLICIES), default="trained",
                   help="the trained policy, or the old policy (EMA) the next rollout samples with")


def find_checkpoint(run_dir: str, step: int | None) -> tuple[int, str]:
    from hpcnft.io import checkpoint

    found = checkpoint.list_checkpoints(run_dir)
    if step is not None:
        found = [c for c in found if c[0] == step]
    usable = [(s, p) for s, p in found if checkpoint.problems(p) is None]
    if not usable:
        what = f"step {step}" if step is not None else "any step"
        raise UsageError(f"{run_dir}: no complete checkpoint for {what}")
    return usable[-1]


def load_transformer(ckpt_path: str, policy: str):
    """The run's base pipeline with the checkpoint's weights of `policy` in its transformer."""
    import torch
    import torch.distributed.checkpoint as dcp

    from hpcnft.algo.policy import add_lora
    from hpcnft.common.config import config_from_dict
    from hpcnft.io.checkpoint import SafeReader, read_json
    from hpcnft.models.loading import load_base_pipeline, resolve_model_paths

    cfg = config_from_dict(read_json(ckpt_path, "config.json"))
    pipe = load_base_pipeline(cfg, resolve_model_paths(cfg).base, torch.float32, torch.device("cpu"))
    tr = pipe.transformer
    if cfg.train.finetune == "lora":
        add_lora(tr, cfg)
    else:
        tr.requires_grad_(True)
    trained = {n: p.detach() for n, p in tr.named_parameters() if p.requires_grad}
    state = {POLICIES[policy]: trained}
    with warnings.catch_warnings():
        # One process without a process group is this command's design, not a mistake to warn about.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        # into the live tensors, reassembling the shards
        dcp.load(state, storage_reader=SafeReader(ckpt_path), no_dist=True)
    return cfg, pipe


def main(name: str, args) -> int:
    run_dir = os.path.dirname(args.run) if args.run.endswith(".h5") else args.run
    step, path = find_checkpoint(run_dir, args.step)
    cfg, pipe = load_transformer(path, args.policy)
    os.makedirs(args.out, exist_ok=True)
    if cfg.train.finetune == "lora":
        from peft.utils import get_peft_model_state_dict

        tr = pipe.transformer
        # The adapter config travels in the file's metadata: without lora_alpha, diffusers would
        # load the adapters with scale 1 instead of alpha / r.
        pipe.save_lora_weights(args.out, transformer_lora_layers=get_peft_model_state_dict(tr),
                               transformer_lora_adapter_metadata=tr.peft_config["default"].to_dict(),
                               safe_serialization=True)
    else:
        pipe.transformer.save_pretrained(args.out, safe_serialization=True)
    kind = "LoRA adapters" if cfg.train.finetune == "lora" else "transformer"
    print(f"exported the {args.policy} policy's {kind} of {path} (step {step}) to {args.out}")
    return 0
