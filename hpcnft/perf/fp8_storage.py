"""perf.base_fp8_storage: a LoRA run's frozen base linears stored in fp8 (e4m3, one fp32 scale
per output channel), half the bytes of fp16, and widened back for each product.

`store_in_fp8` turns every frozen linear of the DiT's blocks (peft's base layers, the attention
projections and feed-forwards; not the per-sample modulation linears) into a `Fp8StoredLinear`:
its `weight` parameter holds the e4m3 values and `weight_scale` their row scales, both frozen,
so FSDP2 shards them like any parameter (one group may hold several dtypes). A forward computes
W = e4m3 * scale in fp32, rounds it once to the product's dtype (the autocast dtype, else the
input's) and multiplies; the backward widens W again for the input's gradient, so no widened
copy outlives its product. There is no weight gradient: the base is frozen.

Rounding: the base model itself changes, once, by e4m3's 3 mantissa bits (up to 2^-4 relative
per weight); the rollout, v_old, the trained forward and the KL reference all see the stored
base. A run's checkpoints hold no frozen weights (they come from disk, quantized again alike),
and `hpcnft export` writes the full-precision base with the trained adapters, as QLoRA's
adapters are used.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hpcnft.common.tensors import linear_dtype
from hpcnft.perf.fp8 import KEEP, quantize_rows

SCALE = "weight_scale"
# The per-sample modulation linears (FLUX's single blocks name theirs norm.linear, Qwen-Image's
# blocks img_mod.1 and txt_mod.1) stay as they are.
KEEP_AS_LOADED = (*KEEP, "norm.", "img_mod.", "txt_mod.")


def widen(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The stored weight [N, K] e4m3 with its row scales [N, 1] as one `dtype` tensor (one rounding)."""
    return (q.float() * scale).to(dtype)


class _StoredProduct(torch.autograd.Function):
    """F.linear(x, widen(q, scale), bias), keeping only q and scale for the backward."""

    @staticmethod
    def forward(ctx, x, q, scale, bias):
        ctx.save_for_backward(q, scale)
        return F.linear(x, widen(q, scale, linear_dtype(x)), bias)

    @staticmethod
    def backward(ctx, grad):
        q, scale = ctx.saved_tensors
        return grad @ widen(q, scale, grad.dtype), None, None, None


class Fp8StoredLinear(torch.nn.Linear):
    """A frozen nn.Linear whose `weight` is e4m3 and `weight_scale` its row scales."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _StoredProduct.apply(x, self.weight, getattr(self, SCALE), self.bias)


def stored_linears(blocks) -> list[torch.nn.Linear]:
    """The frozen plain nn.Linear layers of `blocks` that are stored in fp8 (peft's base layers
    under LoRA; not the modulation linears, one row per sample)."""
    return [m for block in blocks for name, m in block.named_modules()
            if type(m) is torch.nn.Linear and not m.weight.requires_grad and not any(k in name for k in KEEP_AS_LOADED)]


@torch.no_grad()
def store_in_fp8(blocks) -> tuple[int, int]:
    """Store the frozen linears of `blocks` in fp8, in place; returns (bytes before, bytes after)
    of their weights."""
    before = after = 0
    for m in stored_linears(blocks):
        q, scale = quantize_rows(m.weight)
        before += m.weight.numel() * m.weight.element_size()
        m.weight = torch.nn.Parameter(q, requires_grad=False)
        m.register_parameter(SCALE, torch.nn.Parameter(scale, requires_grad=False))
        m.__class__ = Fp8StoredLinear
        after += q.numel() * q.element_size() + scale.numel() * scale.element_size()
    return before, after
