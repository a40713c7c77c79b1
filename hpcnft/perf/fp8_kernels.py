"""Triton kernel of the fp8 rollout (CUDA; imported only there): the feed-forward's bias + tanh
GELU + per-row e4m3 quantization of its hidden activation in one pass over each row.

Compiled by Inductor, the same chain is a looped reduction that reads the [tokens, 4d] row
twice and evaluates the GELU twice (once for the row's amax, once to quantize), with libdevice's
tanh; here a program holds a whole row in registers, reads it once and writes one byte per
element. The GELU is written as h * sigmoid(2u) (= 0.5 h (1 + tanh(u))), which Triton evaluates
with its fast exp: fp32 rounding differences only, far below e4m3's 2^-4. The warp count is
chosen by timing, but every config gives the same bits (a row's max does not depend on the
order of its reduction), so deterministic mode keeps it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.autotune(configs=[triton.Config({}, num_warps=w) for w in (4, 8, 16)], key=["n_cols"])
@triton.jit
def _gelu_quantize_rows(h_ptr, bias_ptr, q_ptr, scale_ptr, n_cols, h_stride, q_stride,
                        HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    h = tl.load(h_ptr + row * h_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        h += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    g = h * tl.sigmoid(1.5957691216057308 * (h + 0.044715 * h * h * h))
    g = tl.where(mask, g, 0.0)
    scale = tl.maximum(tl.max(tl.abs(g), axis=0), 1e-12) / 448.0  # 448: e4m3's largest value (fp8.E4M3_MAX)
    q = tl.clamp(g / scale, -448.0, 448.0)
    tl.store(q_ptr + row * q_stride + cols, q.to(tl.float8e4nv), mask=mask)
    tl.store(scale_ptr + row, scale)


def gelu_quantize_rows(h: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """h [M, N] (any float dtype, CUDA), bias [N] or None -> (q [M, N] e4m3, scale [M, 1] fp32)."""
    h = h.contiguous()
    m, n = h.shape
    q = torch.empty((m, n), dtype=torch.float8_e4m3fn, device=h.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=h.device)
    if m:
        _gelu_quantize_rows[(m,)](h, bias if bias is not None else h, q, scale, n, h.stride(0), q.stride(0),
                                  HAS_BIAS=bias is not None, BLOCK=triton.next_power_of_2(n))
    return q, scale
