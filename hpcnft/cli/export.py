"""`hpcnft export RUN OUT [--step K] [--policy ema|old|trained] [--force]`: the weights of a
checkpoint as a folder diffusers loads directly: LoRA adapters as
`pytorch_lora_weights.safetensors` (`pipe.load_lora_weights(OUT)` on the run's
StableDiffusion3Pipeline, FluxPipeline or WanPipeline), or, for a full fine-tune, a transformer
folder (`SD3Transformer2DModel.from_pretrained(OUT)`, `FluxTransformer2DModel...`,
`WanTransformer3DModel...`).

A checkpoint holds up to three sets of the trained parameters: theta (`trained`), the old policy
pi_old the rollouts sample with (`old`), and with eval.policy="ema" the evaluation EMA of theta
(`ema`, what the official recipe evaluates and saves). The default is the set the run's eval
metrics are of, so the exported weights are the ones `hpcnft show` reports on.

Runs in one process without a process group: DCP reassembles the sharded checkpoint. OUT is
written beside and renamed into place (io.export_folder)."""
from __future__ import annotations

import os
import warnings

from hpcnft.common.errors import UsageError

# --policy -> the checkpoint's state key (io.checkpoint._state)
POLICIES = {"trained": "model", "old": "old_policy", "ema": "eval_ema"}
POLICY_HELP = ("which weights: ema (the evaluation EMA of theta, kept when the run's eval.policy is ema, "
               "as in the official recipe), old (pi_old, the EMA the rollouts sample with) or trained "
               "(theta itself); default: the policy the run's eval metrics are of (its eval.policy)")


def add_arguments(name: str, p) -> None:
    p.add_argument("run", help="a run dir (or its run.h5)")
    p.add_argument("out", help="output folder (refused if it exists, unless --force)")
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest complete one)")
    p.add_argument("--checkpoint", choices=("latest", "best"), default="latest",
                   help="`best`: the checkpoint checkpoint.keep_best kept (checkpoints/BEST), instead of --step")
    p.add_argument("--policy", choices=sorted(POLICIES), default=None, help=POLICY_HELP)
    p.add_argument("--force", action="store_true",
                   help="replace OUT if it holds an earlier export (the new one is written beside it and "
                        "swapped in once complete, so a failed export leaves OUT as it was)")


def best_step(run_dir: str) -> int:
    """The step of the best checkpoint checkpoint.keep_best kept (one line when there is none)."""
    from hpcnft.io.checkpoint_dirs import read_best

    best = read_best(run_dir)
    if best is None:
        raise UsageError(f"{run_dir}: no best checkpoint (checkpoints/BEST; the run's checkpoint.keep_best names "
                         f"the metric that keeps one)")
    return best["step"]


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


def chosen_policy(requested: str | None, eval_policy: str, held: set[str], where: str) -> str:
    """--policy, or the run's eval.policy; refused (one line) when the checkpoint at `where` lacks
    that policy's state."""
    policy = requested or eval_policy
    others = " or ".join(p for p in sorted(POLICIES) if POLICIES[p] in held)
    if policy not in POLICIES:
        raise UsageError(f"{where}: the run's eval.policy is {policy!r}; choose --policy {others}")
    if POLICIES[policy] not in held:
        why = (f"the run's eval.policy is {eval_policy!r}, so it kept no evaluation EMA" if policy == "ema"
               else f"it holds no {POLICIES[policy]!r} state")
        raise UsageError(f"{where}: no {policy} policy in this checkpoint ({why}); choose --policy {others}")
    return policy


def held_states(ckpt_path: str) -> set[str]:
    """The top-level states a checkpoint holds (model, old_policy, eval_ema, optim)."""
    from hpcnft.io.checkpoint import SafeReader

    return {key.split(".", 1)[0] for key in SafeReader(ckpt_path).read_metadata().state_dict_metadata}


def load_transformer(ckpt_path: str, cfg, policy: str):
    """The run's base pipeline with the checkpoint's weights of `policy` in its transformer."""
    import torch
    import torch.distributed.checkpoint as dcp

    from hpcnft.algo.policy import make_trainable
    from hpcnft.io.checkpoint import SafeReader
    from hpcnft.models.loading import load_base_pipeline, resolve_model_paths

    pipe = load_base_pipeline(cfg, resolve_model_paths(cfg).base, torch.float32, torch.device("cpu"))
    tr = pipe.transformer
    make_trainable(tr, cfg)
    trained = {n: p.detach() for n, p in tr.named_parameters() if p.requires_grad}
    state = {POLICIES[policy]: trained}
    with warnings.catch_warnings():
        # One process without a process group is this command's design, not a mistake to warn about.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        # into the live tensors, reassembling the shards
        dcp.load(state, storage_reader=SafeReader(ckpt_path), no_dist=True)
    return pipe


def write_export(pipe, cfg, folder: str) -> None:
    if cfg.train.finetune == "lora":
        from peft.utils import get_peft_model_state_dict

        tr = pipe.transformer
        # The adapter config travels in the file's metadata: without lora_alpha, diffusers would
        # load the adapters with scale 1 instead of alpha / r.
        pipe.save_lora_weights(folder, transformer_lora_layers=get_peft_model_state_dict(tr),
                               transformer_lora_adapter_metadata=tr.peft_config["default"].to_dict(),
                               safe_serialization=True)
    else:
        pipe.transformer.save_pretrained(folder, safe_serialization=True)


def main(name: str, args) -> int:
    from hpcnft.io.export_folder import refusal, written_beside

    why = refusal(args.out, args.force)  # before anything slow, and before anything is written
    if why:
        raise UsageError(why)
    run_dir = os.path.dirname(args.run) if args.run.endswith(".h5") else args.run
    step, path = find_checkpoint(run_dir, best_step(run_dir) if args.checkpoint == "best" else args.step)

    from safetensors import SafetensorError

    from hpcnft.algo.root_config import config_from_dict
    from hpcnft.io.checkpoint import read_json

    cfg = config_from_dict(read_json(path, "config.json"))
    policy = chosen_policy(args.policy, cfg.eval.policy, held_states(path), path)
    pipe = load_transformer(path, cfg, policy)
    replacing = os.path.lexists(args.out)
    try:
        with written_beside(args.out) as folder:
            write_export(pipe, cfg, folder)
    except (OSError, SafetensorError) as e:  # a full disk, a read-only file system
        left = "left as it was" if replacing else "nothing written"
        raise UsageError(f"{args.out}: cannot write the export ({getattr(e, 'strerror', None) or e}); "
                         f"{left}") from None
    kind = "LoRA adapters" if cfg.train.finetune == "lora" else "transformer"
    print(f"exported the {policy} policy's {kind} of {path} (step {step}) to {args.out}"
          + (" (replacing the earlier export)" if replacing else "")
          + ("" if args.policy else f"; {policy} is the run's eval.policy, the default --policy"))
    return 0
