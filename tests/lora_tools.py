"""A tiny SD3.5 DiT (joint attention, an MMDiT-X attn2, q/k RMS norms) with peft LoRA on the
recipe's projections and non-zero B matrices, for tests of the LoRA paths."""
from __future__ import annotations

import torch

from hpcnft import fast
from hpcnft.tiny import TINY_TRANSFORMER
from hpcnft.trainer import add_lora


def tiny_lora_dit(cfg, base_dtype: torch.dtype = torch.float32, b_scale: float = 0.05):
    """peft starts B at zero (the adapter would be a no-op): draw it, seeded, at `b_scale`; the
    frozen base in `base_dtype`, the LoRA weights fp32 as Policy keeps them."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    tr = SD3Transformer2DModel(**TINY_TRANSFORMER)
    add_lora(tr, cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in fast.lora_layers(tr):
            w = layer.lora_B["default"].weight
            w.copy_(torch.randn(w.shape, generator=g) * b_scale)
        for p in tr.parameters():
            if not p.requires_grad:
                p.data = p.data.to(base_dtype)
    return tr


def tiny_policy(**perf):
    """What the LoRA levers read of a Policy (cfg, transformer): the tiny recipe with `perf.*`
    set, in eval mode."""
    import types

    from hpcnft.config import load_config

    cfg = load_config("tiny", [f"perf.{k}={str(v).lower()}" for k, v in perf.items()])
    return types.SimpleNamespace(cfg=cfg, transformer=tiny_lora_dit(cfg).eval())


@torch.no_grad()
def move_adapters(transformer) -> None:
    """What a training step does to the no-grad passes' inputs: the adapters change (B negated)."""
    for layer in fast.lora_layers(transformer):
        layer.lora_B["default"].weight.mul_(-1.0)
