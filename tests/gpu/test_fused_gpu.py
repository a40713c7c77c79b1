"""On a CUDA device, fp16 autocast, eager and with the blocks compiled: the fused attention paths
(perf.fuse_qkv for the merged no-grad forward, perf.fused_lora for the trained forward and its
LoRA gradients) agree with peft's three-projection path to fp16 accuracy."""
from __future__ import annotations

import types

import pytest
import torch

from hpcnft.algo.root_config import load_config
from hpcnft.algo.sampler import velocity
from hpcnft.models.tiny import TINY_TRANSFORMER
from hpcnft.perf import compiling, fused_qkv, levers
from lora_tools import tiny_lora_dit

DEV = torch.device("cuda")


def _policy(compiled: bool, **perf):
    cfg = load_config("tiny", [f"perf.{k}={str(v).lower()}" for k, v in perf.items()])
    tr = tiny_lora_dit(cfg, base_dtype=torch.float16).eval().to(DEV)
    if perf.get("fused_lora"):
        fused_qkv.install_fused_lora(tr)
    if compiled:
        compiling.compile_blocks(tr, list(tr.transformer_blocks))
    return types.SimpleNamespace(cfg=cfg, transformer=tr)


def _inputs():
    c = TINY_TRANSFORMER
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, c["in_channels"], 16, 16, generator=g)
    return (x.to(DEV), torch.tensor([0.9, 0.5, 0.3, 0.1], device=DEV),
            torch.randn(4, 7, c["joint_attention_dim"], generator=g).to(DEV),
            torch.randn(4, c["pooled_projection_dim"], generator=g).to(DEV))


def _forward(policy, grad: bool):
    tr = policy.transformer
    for p in tr.parameters():
        p.grad = None
    with torch.autocast("cuda", dtype=torch.float16), torch.set_grad_enabled(grad):
        v = velocity(tr, *_inputs(), torch.float16).float()
    if not grad:
        return v, {}
    v.square().mean().backward()
    return v.detach(), {n: p.grad.float() for n, p in tr.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fused_attention_paths_match_peft_in_fp16(compiled):
    ref, fused = _policy(compiled, merge_lora_nograd=True), _policy(compiled, merge_lora_nograd=True,
                                                                     fuse_qkv=True, fused_lora=True)
    v_ref, g_ref = _forward(ref, grad=True)
    v_fused, g_fused = _forward(fused, grad=True)
    torch.testing.assert_close(v_fused, v_ref, rtol=2e-2, atol=2e-3)
    for name in g_ref:
        torch.testing.assert_close(g_fused[name], g_ref[name], rtol=5e-2, atol=1e-4, msg=name)
    with levers.nograd_weights(ref):
        m_ref, _ = _forward(ref, grad=False)
    with levers.nograd_weights(fused):
        m_fused, _ = _forward(fused, grad=False)
    torch.testing.assert_close(m_fused, m_ref, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(m_fused, v_fused, rtol=2e-2, atol=2e-3)  # merged ≈ the LoRA forward
