"""perf.compile_blocks and perf.compile_vae: regional torch.compile (static shapes) behind a
guard for dispatch modes, and the Inductor tuning switches."""
from __future__ import annotations

import torch


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
    hpcnft.algo.flops and hpcnft bench use): dynamo refuses such frames and then marks the code object
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


def compile_blocks(transformer, blocks) -> None:
    """Regional torch.compile: each of the DiT's `blocks` compiled on its own (static shapes), the
    rest eager."""
    if getattr(transformer, "_hpcnft_compiled", False):
        return
    _raise_recompile_limits()
    # SD3's blocks, FLUX's double-stream then single-stream blocks, Wan's blocks (Family.fsdp_blocks)
    for block in blocks:
        compile_module(block)
    transformer._hpcnft_compiled = True
