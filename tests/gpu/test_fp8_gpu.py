"""On a CUDA device (fp8 GEMMs need sm89+), fp16 autocast, eager and with the blocks compiled:
perf.rollout_fp8's forward is close to the fp16 forward, compiles, and entering and leaving it
again reuses the compiled graphs of both (no recompilation per rollout)."""
from __future__ import annotations

import pytest
import torch

from hpcnft.perf import fp8, levers
from lora_tools import gpu_policy, tiny_velocity

DEV = torch.device("cuda", 0)
pytestmark = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability(0) < (8, 9),
                                reason="fp8 GEMMs need compute capability 8.9 or newer")


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fp8_rollout_forward_on_the_gpu(compiled):
    import torch._dynamo

    policy = gpu_policy(compiled, "perf.merge_lora_nograd=true", "perf.fuse_qkv=true")
    outs = []
    graphs = torch._dynamo.utils.counters["stats"]
    before = graphs["unique_graphs"]  # other tests of the session may have compiled
    for _ in range(2):  # two rollouts: the second must reuse what the first compiled
        with levers.nograd_weights(policy):
            half = tiny_velocity(policy, "cuda")
            with fp8.blocks_in_fp8(policy.transformer) as n:
                in_fp8 = tiny_velocity(policy, "cuda")
        outs.append((half, in_fp8, graphs["unique_graphs"]))
    (half, in_fp8, first), (half2, in_fp8_2, second) = outs
    assert n > 0 and torch.isfinite(in_fp8).all() and 0 < _rel(in_fp8, half) < 0.05
    assert torch.equal(half2, half) and torch.equal(in_fp8_2, in_fp8)
    assert second == first and (first > before) == compiled, dict(graphs)


@pytest.mark.parametrize("rows,cols,bias", [(300, 6144, True), (77, 1000, True), (5, 64, False)])
def test_feed_forward_kernel_is_the_reference(rows, cols, bias):
    from hpcnft.perf import fp8_kernels

    g = torch.Generator().manual_seed(rows)
    h = (torch.randn(rows, cols, generator=g) * 3).to(DEV, torch.bfloat16)
    b = torch.randn(cols, generator=g).to(DEV, torch.bfloat16) if bias else None
    h[1] = 0 if b is None else -b  # a row that is zero after the bias
    q, scale = fp8_kernels.gelu_quantize_rows(h, b)
    ref_q, ref_scale = fp8.gelu_quantize_rows(h.cpu(), None if b is None else b.cpu())  # the reference, CPU
    assert q.dtype == torch.float8_e4m3fn and q.shape == (rows, cols) and scale.shape == (rows, 1)
    torch.testing.assert_close(scale.cpu(), ref_scale, rtol=1e-5, atol=0)
    diff = (q.float().cpu() - ref_q.float()).abs()
    # fast exp: a value near a rounding boundary of e4m3 may land on the next code, nothing more
    assert float((diff > 0).float().mean()) < 1e-3
    assert float((diff / ref_q.float().abs().clamp(min=1)).max()) <= 2.0 ** -3
    assert torch.equal(q[1].float().cpu(), torch.zeros(cols))
    # and the op dispatches to it on CUDA
    q2, scale2 = fp8.gelu_quantize_rows(h, b)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale2, scale)
