"""On a CUDA device, fp16 autocast, eager and with the blocks compiled: perf.gelu_epilogue's
op is the linear followed by SD3's tanh GELU (cuBLASLt's epilogue), the no-grad forward takes
it and stays close to diffusers' own, and a second pass reuses what the first compiled."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hpcnft.perf import epilogue, levers
from lora_tools import gpu_policy, tiny_velocity

DEV = torch.device("cuda", 0)


def test_the_op_is_the_linear_then_the_tanh_gelu():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(300, 256, generator=g), torch.randn(1024, 256, generator=g) / 16, torch.randn(1024, generator=g)
    pre = F.linear(x.double(), w.double(), b.double())
    tanh, erf = F.gelu(pre, approximate="tanh"), F.gelu(pre)
    # fp32 (no TF32): the two GELUs differ by ~5e-4, far above the GEMM's rounding
    y = epilogue.addmm_gelu(x.to(DEV), w.to(DEV), b.to(DEV)).double().cpu()
    assert float((y - tanh).abs().max()) < 0.1 * float((erf - tanh).abs().max())
    with torch.autocast("cuda", dtype=torch.float16):  # fp16: GELU of the fp32 accumulator
        fused = epilogue.addmm_gelu(x.to(DEV), w.to(DEV), b.to(DEV))
        unfused = F.gelu(F.linear(x.to(DEV), w.to(DEV), b.to(DEV)), approximate="tanh")
    assert fused.dtype == torch.float16
    err_fused = float((fused.double().cpu() - tanh).abs().mean())
    assert err_fused <= float((unfused.double().cpu() - tanh).abs().mean())


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_no_grad_forward_with_the_epilogue(compiled):
    import torch._dynamo

    policy = gpu_policy(compiled, "perf.merge_lora_nograd=true", "perf.fuse_qkv=true", "perf.gelu_epilogue=true")
    graphs = torch._dynamo.utils.counters["stats"]
    plain = tiny_velocity(policy, "cuda")
    outs = []
    for _ in range(2):
        with levers.nograd_weights(policy):
            assert all(isinstance(m, epilogue.EpilogueGELUMixin) for m in epilogue.gelu_modules(policy.transformer))
            outs.append((tiny_velocity(policy, "cuda"), graphs["unique_graphs"]))
    (first, n1), (second, n2) = outs
    assert torch.isfinite(first).all() and float((first - plain).norm() / plain.norm()) < 1e-2
    assert torch.equal(first, second) and n1 == n2
