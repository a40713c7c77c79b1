"""The speed levers, and the one interface through which the algorithm uses them. Each lever
is a `[perf]` config key, off by default; with every lever off the package runs exactly as
before (same code path, same numerics). The mechanisms live beside this module: compiling,
lora_merge, fused_qkv, epilogue, fp8 and towers.

What each lever does, and what it does to the numerics, is said once, beside its key in
hpcnft/perf/config.py (docs/configuration.md's table is made from it), with `FAST`, the
combination `hpcnft bench` measures.

Deterministic mode (`determinism.enabled`) keeps the levers that are deterministic run to run
(skip_single_rank_fsdp, fsdp_cpu_offload, base_fp8_storage, merge_lora_nograd, old_pass_batch,
vae_dtype, vae_channels_last, pickscore_dtype, pickscore_preprocess, fuse_qkv, fused_lora,
overlap_reward, rollout_fp8, v_old_fp8, gelu_epilogue)
and turns off `compile_blocks` and `compile_vae` (Inductor autotunes reduction configs by timing,
so the kernel, and with it the summation order, may differ between runs), `cudnn_benchmark`
(the same, for convolutions) and `attention_backend` (PyTorch then selects the SDPA kernel under
its own deterministic-algorithm rules): see `effective`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch

from hpcnft.perf import compiling, lora_merge, towers
from hpcnft.perf.config import ATTENTION_BACKENDS, FAST  # noqa: F401 (FAST: the levers' combined set)

# The LoRA linears of a model (the Policy sets how they cast their inputs).
lora_layers = lora_merge.lora_layers

CUDA_ONLY = ("perf.compile_blocks", "perf.attention_backend", "perf.compile_vae", "perf.cudnn_benchmark")
DETERMINISM_OFF = {"compile_blocks": False, "compile_vae": False, "cudnn_benchmark": False,
                   "attention_backend": "default", "inductor_tuning": False, "inductor_autotune": False}


def effective(cfg):
    """The perf settings in force: `cfg.perf` with the levers deterministic mode excludes off."""
    perf = cfg.perf
    if getattr(cfg, "determinism", None) is not None and cfg.determinism.enabled:
        perf = dataclasses.replace(perf, **DETERMINISM_OFF)
    return perf


# -- attention backend -------------------------------------------------------------------
def attention_context(cfg):
    """sdpa_kernel for perf.attention_backend (a null context for "default")."""
    name = effective(cfg).attention_backend
    if name == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, ATTENTION_BACKENDS[name])])


def with_attention(cfg, ctx):
    """`ctx` (the policy's autocast) plus the attention backend, when one is set."""
    if effective(cfg).attention_backend == "default":
        return ctx
    stack = contextlib.ExitStack()
    stack.enter_context(ctx)
    stack.enter_context(attention_context(cfg))
    return stack


# -- FSDP on one rank --------------------------------------------------------------------
def use_fsdp(cfg, mesh) -> bool:
    """False when perf.skip_single_rank_fsdp and the train mesh has one rank (but under
    perf.fsdp_cpu_offload, which FSDP2 does)."""
    if cfg.perf.fsdp_cpu_offload:
        return True
    return not (cfg.perf.skip_single_rank_fsdp and mesh is not None and mesh.size() == 1)


def fsdp_options(cfg, device: torch.device, transformer) -> dict:
    """fully_shard's keyword arguments for the levers in force: perf.fsdp_cpu_offload's policy,
    perf.replicate_frozen_base's ignored (whole, unsharded) frozen parameters."""
    if cfg.perf.replicate_frozen_base:
        return {"ignored_params": {p for p in transformer.parameters() if not p.requires_grad}}
    if not cfg.perf.fsdp_cpu_offload:
        return {}
    from torch.distributed.fsdp import CPUOffloadPolicy

    return {"offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda")}


def store_base_weights(cfg, blocks) -> str:
    """perf.base_fp8_storage: the frozen linears of the DiT's `blocks` stored in fp8 (fp8_storage);
    returns what the user is told of it ("" when off)."""
    if not cfg.perf.base_fp8_storage:
        return ""
    from hpcnft.perf import fp8_storage

    before, after = fp8_storage.store_in_fp8(blocks)
    size = (lambda n: f"{n / 2**30:.2f} GiB") if before >= 2**30 else (lambda n: f"{n / 2**20:.2f} MiB")
    return (f"perf.base_fp8_storage: the blocks' frozen linears hold {size(after)} in fp8 instead of "
            f"{size(before)}, before FSDP2 shards them")


def _nested_fsdp(block) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in block.modules() if m is not block)


def prepare_policy(policy) -> None:
    """Construction-time levers of a Policy (called at the end of Policy.__init__)."""
    perf = effective(policy.cfg)
    nested_fsdp = any(_nested_fsdp(b) for b in policy.blocks)
    if perf.fused_lora:
        if nested_fsdp:
            # The fused path reads the LoRA weights directly, around FSDP2's per-linear unshard hooks.
            logging.getLogger("hpcnft").warning(
                "perf.fused_lora: skipped, the LoRA linears are FSDP2 groups; on one rank set "
                "perf.skip_single_rank_fsdp=true")
        else:
            from hpcnft.perf import fused_qkv

            fused_qkv.install_fused_lora(policy.transformer)
    if perf.compile_blocks and policy.device.type == "cuda":
        if nested_fsdp:
            # A half-precision base puts each LoRA linear in its own FSDP2 group; dynamo breaks the
            # graph at every one of their hooks (~16 per block), so compiling would gain nothing.
            logging.getLogger("hpcnft").warning(
                "perf.compile_blocks: skipped, the blocks hold FSDP2 groups (LoRA linears); on one rank set "
                "perf.skip_single_rank_fsdp=true")
            return
        compiling.inductor_options(perf)
        compiling.compile_blocks(policy.transformer, policy.blocks)


# -- no-grad passes of the old policy ---------------------------------------------------------
@contextlib.contextmanager
def nograd_weights(policy):
    """The levers of the old policy's no-grad passes (rollout, v_old): LoRA merged into the base
    (perf.merge_lora_nograd), then q/k/v fused on those weights (perf.fuse_qkv), and the
    feed-forwards' GELU in their first GEMM's epilogue (perf.gelu_epilogue)."""
    from hpcnft.perf import epilogue, fused_qkv

    perf = effective(policy.cfg)
    with contextlib.ExitStack() as stack:
        stack.enter_context(merged_lora(policy))
        if perf.fuse_qkv:
            stack.enter_context(fused_qkv.fused(policy.transformer))
        if perf.gelu_epilogue:
            stack.enter_context(epilogue.feed_forwards(policy.transformer))
        yield


def merged_lora(policy):
    """perf.merge_lora_nograd for a LoRA policy: its deltas merged into the base weights while
    inside (lora_merge.merged); otherwise nothing changes."""
    if effective(policy.cfg).merge_lora_nograd and policy.cfg.train.finetune == "lora":
        return lora_merge.merged(policy.transformer)
    return contextlib.nullcontext()


def fp8_blocks(policy, lever: str | None):
    """The blocks' GEMMs in fp8 while inside, for the lever named (perf.rollout_fp8 or
    perf.v_old_fp8); None: nothing changes."""
    if not lever:
        return contextlib.nullcontext()
    from hpcnft.perf import fp8

    return fp8.blocks_in_fp8(policy.transformer, lever)


def old_velocities(forward, size: int, batch, mbs) -> list[torch.Tensor]:
    """v_old for every micro-batch, computed in passes of perf.old_pass_batch pairs over the
    concatenated micro-batches, then split back into the micro-batch composition."""
    index = torch.cat([m.index for m in mbs])
    sig = torch.cat([m.sigma for m in mbs])
    x_sigma = torch.cat([m.x_sigma for m in mbs])
    outs = [forward(x_sigma[i:i + size], sig[i:i + size], batch, index[i:i + size])
            for i in range(0, len(index), size)]
    return list(torch.cat(outs).split([len(m.pos) for m in mbs]))


# -- VAE and PickScore --------------------------------------------------------------------------
def prepare_vae(vae, cfg):
    """The VAE under the levers in force (towers.prepare_vae)."""
    return towers.prepare_vae(vae, effective(cfg))


def prepare_scorer(scorer, cfg):
    """The PickScore scorer under perf.pickscore_dtype and perf.pickscore_preprocess."""
    return towers.prepare_scorer(scorer, cfg)
