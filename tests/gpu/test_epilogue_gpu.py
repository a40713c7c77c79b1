"""On a CUDA device, fp16 autocast, eager and with the blocks compiled: perf.gelu_epilogue's
op is the linear followed by SD3's tanh GELU (cuBLASLt's epilogue), the no-grad forward takes
it and stays close to diffusers' own, and a second pass reuses what the first compiled."""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from hpcnft import epilogue, fast
from hpcnft.config import load_config
from hpcnft.sampler import velocity
from hpcnft.tiny import TINY_TRANSFORMER
from lora_tools import tiny_lora_dit

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


def _policy(compiled: bool):
    cfg = load_config("tiny", ["perf.merge_lora_nograd=true", "perf.fuse_qkv=true", "perf.gelu_epilogue=true"])
    tr = tiny_lora_dit(cfg, base_dtype=torch.float16).eval().to(DEV)
    if compiled:
        fast.compile_blocks(tr)
    return types.SimpleNamespace(cfg=cfg, transformer=tr)


def _velocity(policy):
    c = TINY_TRANSFORMER
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, c["in_channels"], 16, 16, generator=g).to(DEV)
    pe = torch.randn(4, 7, c["joint_attention_dim"], generator=g).to(DEV)
    pooled = torch.randn(4, c["pooled_projection_dim"], generator=g).to(DEV)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        return velocity(policy.transformer, x, torch.tensor([0.9, 0.5, 0.3, 0.1], device=DEV), pe, pooled,
                        torch.float16).float()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_no_grad_forward_with_the_epilogue(compiled):
    import torch._dynamo

    policy = _policy(compiled)
    graphs = torch._dynamo.utils.counters["stats"]
    plain = _velocity(policy)
    outs = []
    for _ in range(2):
        with fast.nograd_weights(policy):
            assert all(isinstance(m, epilogue.EpilogueGELUMixin) for m in epilogue.gelu_modules(policy.transformer))
            outs.append((_velocity(policy), graphs["unique_graphs"]))
    (first, n1), (second, n2) = outs
    assert torch.isfinite(first).all() and float((first - plain).norm() / plain.norm()) < 1e-2
    assert torch.equal(first, second) and n1 == n2
