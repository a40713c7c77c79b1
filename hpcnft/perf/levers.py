"""The speed levers, and the one interface through which the algorithm uses them. Each lever
is a `[perf]` config key, off by default; with every lever off the package runs exactly as
before (same code path, same numerics). The mechanisms live beside this module: compiling,
lora_merge, fused_qkv, epilogue, fp8 and towers.

| key | what it does | numerics |
|---|---|---|
| perf.attention_backend | SDPA backend for every DiT forward (and its backward): flash, cudnn, efficient, math | backend-dependent rounding |
| perf.compile_blocks | regional torch.compile of each DiT transformer block (static shapes, raised recompile limit); GPU only, and only where no FSDP2 group sits inside a block (a half-precision LoRA run under FSDP2 has one per LoRA linear, and dynamo breaks the graph at each: use it with skip_single_rank_fsdp) | fused kernels round differently |
| perf.skip_single_rank_fsdp | on a one-rank train mesh, keep the plain module (no FSDP2 wrapping: no per-block and per-LoRA-linear all-gathers) | identical |
| perf.merge_lora_nograd | the old-policy (no-grad) passes, rollout and v_old, run on W + s·B·A merged into the half-precision base weights, adapters off; the base weights are restored bit for bit afterwards | one fp16 rounding of W + ΔW instead of two matmuls |
| perf.old_pass_batch | v_old for all of a step's pairs in batches of this size (0: per micro-batch, as before) | GEMM batch size changes rounding |
| perf.vae_dtype | VAE decode in fp16/bf16 instead of the loaded fp32 (helper: `prepare_vae`) | half-precision decode |
| perf.vae_channels_last | VAE decode in channels-last memory format (helper: `prepare_vae`) | conv algorithm choice |
| perf.pickscore_dtype | PickScore towers in fp16, embeddings and the score in fp32 (helper: `prepare_scorer`) | fp16 towers |
| perf.pickscore_preprocess | "device": CLIP's resize/crop/normalise as tensor ops on the scorer's device instead of PIL on the CPU (`rewards.pickscore.clip_pixel_values`), prompts padded to 77 tokens (one text-tower shape) | antialiased bicubic of torch, not PIL: pixels within about a grey level; text rounding only |
| perf.fuse_qkv | the no-grad passes compute q, k, v (and the text stream's) with one GEMM on concatenated weights (`perf.fused_qkv`); LoRA needs merge_lora_nograd | one GEMM's rounding instead of three |
| perf.fused_lora | the trained forward computes a stream's q, k, v with one frozen base GEMM on concatenated weights and one GEMM on the concatenated LoRA A matrices (`perf.fused_qkv`); not under FSDP2 per-linear groups | GEMM rounding |
| perf.overlap_reward | world 1: PickScore of a chunk in a worker thread while the next chunk samples (`LocalRewardClient`) | identical |
| perf.compile_vae | torch.compile of the VAE decoder (helper: `prepare_vae`); GPU only | fused kernels round differently |
| perf.cudnn_benchmark | cuDNN times its convolution algorithms and keeps the fastest (helper: `prepare_vae`); GPU only | algorithm choice |
| perf.inductor_tuning | Inductor tunes the block sizes of every Triton kernel it generates by timing (coordinate descent) for the compiled blocks and VAE | as compile (kernel choice) |
| perf.inductor_autotune | Inductor compiles a wider set of block-size configs for each pointwise and reduction kernel it generates (`max_autotune_pointwise`; in parallel worker processes) and times them at the first call | as compile (kernel choice) |
| perf.gelu_epilogue | the no-grad passes (rollout, v_old) compute each feed-forward's first linear and its tanh GELU as one GEMM with cuBLASLt's GELU epilogue (`perf.epilogue`) | GELU of the fp32 accumulator, not of its fp16 rounding |
| perf.rollout_fp8 | the rollout's DiT blocks multiply in fp8 (e4m3; weights scaled per output channel, activations per token; `perf.fp8`); v_old (but under perf.v_old_fp8), training and evaluation keep their precision; needs fp8 GEMMs (sm89+, or the CPU) | fp8 rounding of every block GEMM's inputs: `hpcnft bench` reports the cost (`rollout_fp8_cost`) |
| perf.v_old_fp8 | the train step's v_old pass (no grad) multiplies in fp8 the same way; the trained forward, its backward and the KL reference keep their precision | fp8 rounding of the NFT loss's old velocity: `hpcnft bench` reports the cost in v_old, loss and gradient (`v_old_fp8_cost`, also against fp32 arithmetic); with pi_old == pi_theta the two branches no longer agree bit for bit |

Deterministic mode (`determinism.enabled`) keeps the levers that are deterministic run to run
(skip_single_rank_fsdp, merge_lora_nograd, old_pass_batch, vae_dtype, vae_channels_last,
pickscore_dtype, pickscore_preprocess, fuse_qkv, fused_lora, overlap_reward, rollout_fp8,
v_old_fp8, gelu_epilogue)
and turns off `compile_blocks` and `compile_vae` (Inductor autotunes reduction configs by timing,
so the kernel, and with it the summation order, may differ between runs), `cudnn_benchmark`
(the same, for convolutions) and `attention_backend` (PyTorch then selects the SDPA kernel under
its own deterministic-algorithm rules): see `effective`.

`FAST` is the combination `hpcnft bench` measures as "hpcnft fast"; `hpcnft bench --shapes
sd35m --baseline --levers all` prints what each lever gives alone and together. Measured on one
H200 (docs/bench/README.md): FAST runs an iteration in 14.5 s against 29.7 s for the plain
diffusers + peft stack; channels-last VAE, the flash/efficient SDPA backends (cuDNN's, PyTorch's
own pick, is the fastest there), batches of 64 and overlap_reward gave no gain there and are
left out of FAST.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch

from hpcnft.perf import compiling, lora_merge, towers

# The LoRA linears of a model (the Policy sets how they cast their inputs).
lora_layers = lora_merge.lora_layers

# The combined set: config overrides (as `--set` would give them).
FAST = {
    "perf.compile_blocks": True,
    "perf.skip_single_rank_fsdp": True,
    "perf.merge_lora_nograd": True,
    "perf.fuse_qkv": True,
    "perf.fused_lora": True,
    "perf.compile_vae": True,
    "perf.cudnn_benchmark": True,
    "perf.pickscore_preprocess": "device",
    "perf.old_pass_batch": 32,
    "perf.vae_dtype": "fp16",
    "perf.pickscore_dtype": "fp16",
    # Larger batches halve the kernel launches per sample: at 16 the train step is bound by the
    # CPU launching kernels (the GPU idles ~27 % of it).
    "rollout.batch_size": 32,
    "train.micro_batch": 32,
    "train.grad_checkpointing": False,
}
CUDA_ONLY = ("perf.compile_blocks", "perf.attention_backend", "perf.compile_vae", "perf.cudnn_benchmark")
DETERMINISM_OFF = {"compile_blocks": False, "compile_vae": False, "cudnn_benchmark": False,
                   "attention_backend": "default", "inductor_tuning": False, "inductor_autotune": False}

_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
             "math": "MATH"}


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

    return sdpa_kernel([getattr(SDPBackend, _BACKENDS[name])])


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
    """False when perf.skip_single_rank_fsdp and the train mesh has one rank."""
    return not (cfg.perf.skip_single_rank_fsdp and mesh is not None and mesh.size() == 1)


def _nested_fsdp(block) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in block.modules() if m is not block)


def prepare_policy(policy) -> None:
    """Construction-time levers of a Policy (called at the end of Policy.__init__)."""
    perf = effective(policy.cfg)
    nested_fsdp = any(_nested_fsdp(b) for b in policy.transformer.transformer_blocks)
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
        compiling.compile_blocks(policy.transformer)


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
