"""Speed levers for the GPU path (issue 7). Each is a `[perf]` config key, off by default; with
every lever off the package runs exactly as before (same code path, same numerics).

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
| perf.pickscore_preprocess | "device": CLIP's resize/crop/normalise as tensor ops on the scorer's device instead of PIL on the CPU (`reward.clip_pixel_values`), prompts padded to 77 tokens (one text-tower shape) | antialiased bicubic of torch, not PIL: pixels within about a grey level; text rounding only |
| perf.fuse_qkv | the no-grad passes compute q, k, v (and the text stream's) with one GEMM on concatenated weights (`hpcnft.fused_qkv`); LoRA needs merge_lora_nograd | one GEMM's rounding instead of three |
| perf.fused_lora | the trained forward computes a stream's q, k, v with one frozen base GEMM on concatenated weights and one GEMM on the concatenated LoRA A matrices (`hpcnft.fused_qkv`); not under FSDP2 per-linear groups | GEMM rounding |
| perf.overlap_reward | world 1: PickScore of a chunk in a worker thread while the next chunk samples (`LocalRewardClient`) | identical |
| perf.compile_vae | torch.compile of the VAE decoder (helper: `prepare_vae`); GPU only | fused kernels round differently |
| perf.cudnn_benchmark | cuDNN times its convolution algorithms and keeps the fastest (helper: `prepare_vae`); GPU only | algorithm choice |
| perf.inductor_tuning | Inductor tunes the block sizes of every Triton kernel it generates by timing (coordinate descent) for the compiled blocks and VAE | as compile (kernel choice) |
| perf.inductor_autotune | Inductor compiles a wider set of block-size configs for each pointwise and reduction kernel it generates (`max_autotune_pointwise`; in parallel worker processes) and times them at the first call | as compile (kernel choice) |
| perf.gelu_epilogue | the no-grad passes (rollout, v_old) compute each feed-forward's first linear and its tanh GELU as one GEMM with cuBLASLt's GELU epilogue (`hpcnft.epilogue`) | GELU of the fp32 accumulator, not of its fp16 rounding |
| perf.rollout_fp8 | the rollout's DiT blocks multiply in fp8 (e4m3; weights scaled per output channel, activations per token; `hpcnft.fp8`); v_old (but under perf.v_old_fp8), training and evaluation keep their precision; needs fp8 GEMMs (sm89+, or the CPU) | fp8 rounding of every block GEMM's inputs: `hpcnft bench` reports the cost (`rollout_fp8_cost`) |
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


# -- regional compile ----------------------------------------------------------------------
def _raise_recompile_limits(limit: int = 64) -> None:
    import torch._dynamo

    c = torch._dynamo.config
    # Blocks with and without attn2, the last (context_pre_only) block, grad and no-grad, merged
    # and LoRA forwards, and each batch size are separate graphs of the same code object.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(c, name):
            setattr(c, name, max(int(getattr(c, name)), limit))
    if hasattr(c, "accumulated_recompile_limit"):
        c.accumulated_recompile_limit = max(int(c.accumulated_recompile_limit), 16 * limit)


class _CompiledCall:
    """A block's compiled call that steps aside under a TorchDispatchMode (FlopCounterMode, as
    hpcnft.perf and hpcnft bench use): dynamo refuses such frames and then marks the code object
    as skipped for good, which would leave every later call of the blocks uncompiled."""

    def __init__(self, eager, compiled):
        self.eager, self.compiled = eager, compiled

    def __call__(self, *args, **kwargs):
        if _in_dispatch_mode():
            return self.eager(*args, **kwargs)
        return self.compiled(*args, **kwargs)


def _in_dispatch_mode() -> bool:
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode

    try:
        return is_in_torch_dispatch_mode(include_infra_modes=False)
    except TypeError:  # older signature
        return is_in_torch_dispatch_mode()


def compile_module(module) -> None:
    """What nn.Module.compile does (static shapes), behind the dispatch-mode guard above."""
    module._compiled_call_impl = _CompiledCall(module._call_impl, torch.compile(module._call_impl, dynamic=False))


def inductor_options(perf) -> None:
    """Process-wide Inductor settings for what is compiled next. perf.inductor_tuning: Inductor
    searches each generated Triton kernel's block sizes and warps by timing, one variant after
    another (coordinate descent; slow to compile). perf.inductor_autotune: it compiles a wider
    fixed set of configs per pointwise and reduction kernel, in parallel worker processes, and
    times them at the first call. Either instead of its heuristic pick."""
    import torch._inductor.config as inductor

    inductor.coordinate_descent_tuning = bool(perf.inductor_tuning)
    inductor.max_autotune_pointwise = bool(perf.inductor_autotune)


def compile_blocks(transformer) -> None:
    """Regional torch.compile: each DiT block compiled on its own (static shapes), the rest eager."""
    if getattr(transformer, "_hpcnft_compiled", False):
        return
    _raise_recompile_limits()
    for block in transformer.transformer_blocks:
        compile_module(block)
    transformer._hpcnft_compiled = True


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
        inductor_options(perf)
        compile_blocks(policy.transformer)


# -- merged LoRA for no-grad passes -------------------------------------------------------------
def full_tensor(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _local_rows(delta: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The rows of a full [out, in] delta that this rank holds of `weight` (FSDP2: Shard(0))."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(weight, DTensor):
        return delta
    (placement,) = weight.placements
    if not isinstance(placement, Shard) or placement.dim != 0:
        raise NotImplementedError(f"perf.merge_lora_nograd: unsupported placement {placement}")
    mesh = weight.device_mesh
    return torch.chunk(delta, mesh.size(), dim=0)[mesh.get_local_rank()]


def lora_layers(module):
    from peft.tuners.lora import LoraLayer

    return [m for m in module.modules() if isinstance(m, LoraLayer)]


def module_list(root, key: str, find):
    """`find(root)`, computed once per module tree and kept on it: the DiT's modules do not change
    once the Policy is built, and walking its ~3,000 modules at every entry of a no-grad pass left
    the GPU waiting (the rollout's and v_old's entries, each iteration)."""
    cache = root.__dict__.setdefault("_hpcnft_module_lists", {})
    if key not in cache:
        cache[key] = find(root)
    return cache[key]


def linear_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype F.linear(x, ...) gives: the autocast dtype where autocast is on, else x's (for
    the levers that replace a linear by their own GEMMs)."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


_MIXED: dict = {}


@contextlib.contextmanager
def mixed_in(modules, mixin, prefix: str):
    """While inside, each module's class is a subclass of (mixin, its class), named prefix +
    its class's name and made once per class, so isinstance and super().forward still hold; on
    exit the classes are put back. How the levers swap a module's forward without copying it."""
    originals = [type(m) for m in modules]
    try:
        for m, cls in zip(modules, originals):
            if (mixin, cls) not in _MIXED:
                _MIXED[mixin, cls] = type(prefix + cls.__name__, (mixin, cls), {})
            m.__class__ = _MIXED[mixin, cls]
        yield
    finally:
        for m, cls in zip(modules, originals):
            m.__class__ = cls


def set_adapters(layers, enabled: bool) -> None:
    """peft LoRA layers on or off by the flag their forward reads. diffusers' enable/disable_adapters
    walk every module and re-set requires_grad on each adapter (~1,100 calls for the real DiT);
    the merged passes run without gradients, so the trainable set is simply left as it is."""
    for layer in layers:
        layer._disable_adapters = not enabled


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


@contextlib.contextmanager
def merged_lora(policy):
    """While inside: the base weights of every LoRA linear hold W + scaling * B @ A (computed in
    fp32, rounded once to the base dtype) and the adapters are off, so a forward is the plain
    base model (no rank-r side matmuls). On exit the saved base weights are copied back (bit
    exact) and the adapters are on again. For no-grad use (rollout, v_old)."""
    if not (effective(policy.cfg).merge_lora_nograd and policy.cfg.train.finetune == "lora"):
        yield
        return

    tr = policy.transformer
    layers = module_list(tr, "lora_layers", lora_layers)
    saved = []  # (base weights, their saved copies)
    try:
        with torch.no_grad():
            adapters = [_plain_adapter(layer) for layer in layers]
            for group in _merge_groups([(layer, n) for layer, n in zip(layers, adapters) if n is not None]):
                saved.append(_merge_stacked(group))
            for layer, name in zip(layers, adapters):
                if name is None:
                    saved.append(_merge_one(layer))
        set_adapters(layers, False)
        yield
    finally:
        if saved:
            set_adapters(layers, True)
        with torch.no_grad():
            for weights, originals in saved:
                torch._foreach_copy_(weights, originals)


def _plain_adapter(layer) -> str | None:
    """The adapter of a layer merged in stacked groups (one active adapter, weights not sharded,
    [out, in] layout), or None for a layer merged on its own."""
    from torch.distributed.tensor import DTensor

    names = [n for n in layer.active_adapters if n in layer.lora_A]
    if len(names) != 1 or layer.fan_in_fan_out:
        return None
    tensors = (layer.get_base_layer().weight, layer.lora_A[names[0]].weight, layer.lora_B[names[0]].weight)
    return None if any(isinstance(t, DTensor) for t in tensors) else names[0]


def _merge_groups(named, most: int = 64) -> list[list]:
    """(layer, adapter) pairs whose base and adapter weights have one shape, dtype and device, at
    most `most` a group (the stacked copies stay a few GiB)."""
    groups: dict = {}
    for layer, name in named:
        w, a = layer.get_base_layer().weight, layer.lora_A[name].weight
        groups.setdefault((w.shape, w.dtype, w.device, a.shape, a.dtype), []).append((layer, name))
    return [g[i:i + most] for g in groups.values() for i in range(0, len(g), most)]


def _merge_stacked(group) -> tuple[list, list]:
    """W + scaling * B @ A for a group of (plain LoRA layer, adapter) pairs as one batched product
    (computed in fp32, rounded once to the base dtype) and one foreach copy: per layer, the real
    DiT's ~200 LoRA linears made ~2,000 small kernels whose launches the GPU waited on."""
    weights = [layer.get_base_layer().weight for layer, _ in group]
    a = torch.stack([layer.lora_A[n].weight for layer, n in group]).float()
    b = torch.stack([layer.lora_B[n].weight for layer, n in group]).float()
    scales = [layer.scaling[n] for layer, n in group]
    # one scale (the usual case) as a number: a tensor of scales would be a host-to-device copy
    scaling = scales[0] if len(set(scales)) == 1 else torch.tensor(scales, device=a.device).view(-1, 1, 1)
    original = torch.stack(weights)
    merged = (original.float() + torch.bmm(b, a) * scaling).to(original.dtype)
    torch._foreach_copy_(weights, list(merged.unbind(0)))
    return weights, list(original.unbind(0))


def _merge_one(layer) -> tuple[list, list]:
    """The same for one layer of any kind peft has (several adapters, fan_in_fan_out, FSDP2 shards)."""
    from hpcnft.algo.trainer import _local

    weight = layer.get_base_layer().weight
    local = _local(weight)
    delta = torch.zeros(weight.shape, dtype=torch.float32, device=local.device)
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        a, b = full_tensor(layer.lora_A[name].weight), full_tensor(layer.lora_B[name].weight)
        d = b.float() @ a.float()
        delta += (d.T if layer.fan_in_fan_out else d) * layer.scaling[name]
    original = local.clone()
    local.copy_((local.float() + _local_rows(delta, weight)).to(local.dtype))
    return [local], [original]


# -- batched v_old --------------------------------------------------------------------------------
def old_velocities(trainer, batch, mbs) -> list[torch.Tensor]:
    """v_old for every micro-batch, computed in passes of perf.old_pass_batch pairs over the
    concatenated micro-batches, then split back into the micro-batch composition."""
    size = int(trainer.cfg.perf.old_pass_batch)
    index = torch.cat([m.index for m in mbs])
    sig = torch.cat([m.sigma for m in mbs])
    x_sigma = torch.cat([m.x_sigma for m in mbs])
    outs = [trainer._forward(x_sigma[i:i + size], sig[i:i + size], batch, index[i:i + size])
            for i in range(0, len(index), size)]
    return list(torch.cat(outs).split([len(m.pos) for m in mbs]))


# -- VAE and PickScore ------------------------------------------------------------------------
VAE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def prepare_vae(vae, cfg):
    """perf.vae_dtype (decode_to_uint8 casts the latents to the VAE's dtype), channels-last
    convolutions (NHWC, the tensor cores' native layout), a compiled decoder, and cuDNN's
    algorithm search (a process-wide switch; the VAE is what convolves)."""
    perf = effective(cfg)
    if perf.vae_dtype != "auto":
        vae.to(VAE_DTYPES[perf.vae_dtype])
    if perf.vae_channels_last:
        vae.to(memory_format=torch.channels_last)
    on_gpu = next(vae.parameters()).device.type == "cuda"
    if perf.cudnn_benchmark and on_gpu:
        torch.backends.cudnn.benchmark = True
    if perf.compile_vae and on_gpu and not getattr(vae.decoder, "_hpcnft_compiled", False):
        inductor_options(perf)
        compile_module(vae.decoder)
        vae.decoder._hpcnft_compiled = True
    return vae


class HalfPickScore:
    """A CLIPModel in half precision behind the three members PickScoreScorer uses: pixel
    values are cast in, embeddings come out in fp32, and logit_scale stays fp32."""

    def __init__(self, model, dtype=torch.float16):
        self.logit_scale = model.logit_scale.detach().float().clone()
        self.model = model.to(dtype)
        self.dtype = dtype

    @staticmethod
    def _fp32(out) -> torch.Tensor:
        return (out if isinstance(out, torch.Tensor) else out.pooler_output).float()

    def get_image_features(self, pixel_values, **kw):
        return self._fp32(self.model.get_image_features(pixel_values=pixel_values.to(self.dtype), **kw))

    def get_text_features(self, **kw):
        return self._fp32(self.model.get_text_features(**kw))


def prepare_scorer(scorer, cfg):
    """perf.pickscore_dtype = fp16: the scorer's model in half precision; perf.pickscore_preprocess
    = device: CLIP's image preprocessing as tensor ops on the scorer's device and prompts padded
    to 77 tokens (PickScoreScorer)."""
    if cfg.perf.pickscore_dtype == "fp16" and not isinstance(scorer.model, HalfPickScore):
        scorer.model = HalfPickScore(scorer.model, torch.float16)
    scorer.preprocess_on_device = cfg.perf.pickscore_preprocess == "device"
    return scorer
