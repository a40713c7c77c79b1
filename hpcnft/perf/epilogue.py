"""perf.gelu_epilogue: the feed-forwards' first linear and its tanh GELU as one GEMM.

In the no-grad passes (rollout, v_old) each feed-forward's `GELU` module (diffusers: a linear,
then GELU with the tanh approximation) runs as `torch._addmm_activation(..., use_gelu=True)`:
on CUDA, cuBLASLt's bias + GELU epilogue applies the activation to the fp32 accumulator before
the half-precision result is written, so the [tokens, 4d] pre-activation is never written and
read back by a separate elementwise kernel (at the real shapes 0.4 GB per feed-forward of a
32-sample batch). The op's GELU depends on the device: the tanh approximation SD3 uses on
CUDA (cuBLASLt's epilogue), the exact (erf) GELU on the CPU; a module takes the op only where
the two GELUs agree (`OP_GELU`).

Rounding: GELU of the fp32 accumulator instead of GELU of its half-precision rounding. The
module falls back to diffusers' own forward where the epilogue does not apply: gradients
enabled on any of its inputs (the op has no backward), another GELU than the op's on that
device, no bias, or a first linear that is not a plain nn.Linear (fp8 under perf.rollout_fp8,
a LoRA wrapper).
"""
from __future__ import annotations

import contextlib

import torch

from hpcnft.common.tensors import linear_dtype, mixed_in, module_list

# The GELU (F.gelu's `approximate`) torch._addmm_activation(use_gelu=True) applies, per device.
OP_GELU = {"cuda": "tanh", "cpu": "none"}


def _count_flops_as_addmm() -> None:
    """FlopCounterMode (hpcnft bench, the perf metrics) has no formula for this op: count its
    GEMM as addmm's."""
    from torch.utils import flop_counter

    op = torch.ops.aten._addmm_activation
    if op not in flop_counter.flop_registry and op.default not in flop_counter.flop_registry:
        def gemm_flops(bias_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
            (m, k), (_, n) = a_shape, b_shape
            return 2 * m * k * n
        flop_counter.register_flop_formula(op)(gemm_flops)


_count_flops_as_addmm()


def addmm_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu(F.linear(x, weight, bias), approximate=OP_GELU[device]) as one GEMM with a GELU
    epilogue, in the autocast dtype when autocast is on (as F.linear would), else in x's."""
    dtype = linear_dtype(x)
    rows = x.reshape(-1, x.shape[-1]).to(dtype)
    y = torch._addmm_activation(bias.to(dtype), rows, weight.to(dtype).t(), use_gelu=True)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def applies(module, x: torch.Tensor) -> bool:
    proj = module.proj
    return (OP_GELU.get(x.device.type) == module.approximate and type(proj) is torch.nn.Linear and proj.bias is not None
            and not (torch.is_grad_enabled() and (x.requires_grad or proj.weight.requires_grad
                                                  or proj.bias.requires_grad)))


class EpilogueGELUMixin:
    """Mixed into the class of diffusers' GELU modules by `feed_forwards` (and back out)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not applies(self, hidden_states):
            return super().forward(hidden_states)
        return addmm_gelu(hidden_states, self.proj.weight, self.proj.bias)


def gelu_modules(transformer) -> list:
    from diffusers.models.activations import GELU

    return module_list(transformer, "gelu_modules",
                       lambda t: [m for m in t.transformer_blocks.modules() if type(m) is GELU])


@contextlib.contextmanager
def feed_forwards(transformer):
    """While inside, the blocks' GELU modules use the GEMM epilogue (where it applies)."""
    modules = gelu_modules(transformer)
    with mixed_in(modules, EpilogueGELUMixin, "Epilogue"):
        yield len(modules)
