"""A tiny SD3.5 DiT (joint attention, an MMDiT-X attn2, q/k RMS norms) with peft LoRA on the
recipe's projections and non-zero B matrices, for tests of the LoRA paths."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hpcnft.algo.policy import add_lora
from hpcnft.models.tiny import TINY_TRANSFORMER
from hpcnft.perf import compiling, levers


def tiny_lora_dit(cfg, base_dtype: torch.dtype = torch.float32, b_scale: float = 0.05):
    """peft starts B at zero (the adapter would be a no-op): draw it, seeded, at `b_scale`; the
    frozen base in `base_dtype`, the LoRA weights fp32 as Policy keeps them."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    tr = SD3Transformer2DModel(**TINY_TRANSFORMER)
    add_lora(tr, cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in levers.lora_layers(tr):
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

    from hpcnft.algo.root_config import load_config

    cfg = load_config("tiny", [f"perf.{k}={str(v).lower()}" for k, v in perf.items()])
    return types.SimpleNamespace(cfg=cfg, transformer=tiny_lora_dit(cfg).eval())


@torch.no_grad()
def move_adapters(transformer) -> None:
    """What a training step does to the no-grad passes' inputs: the adapters change (B negated)."""
    for layer in levers.lora_layers(transformer):
        layer.lora_B["default"].weight.mul_(-1.0)


def tiny_velocity(policy, device: str = "cpu") -> torch.Tensor:
    """The no-grad velocity of `policy` at seeded inputs: 3 samples at 8x8 in fp32 on the CPU;
    4 at 16x16 under fp16 autocast (returned as fp32) on a GPU."""
    import contextlib

    from hpcnft.algo.sampler import velocity

    c = TINY_TRANSFORMER
    n, size, tokens, sigmas = (3, 8, 5, [0.9, 0.5, 0.1]) if device == "cpu" else (4, 16, 7, [0.9, 0.5, 0.3, 0.1])
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, c["in_channels"], size, size, generator=g).to(device)
    pe = torch.randn(n, tokens, c["joint_attention_dim"], generator=g).to(device)
    pooled = torch.randn(n, c["pooled_projection_dim"], generator=g).to(device)
    half = device != "cpu"
    autocast = torch.autocast("cuda", dtype=torch.float16) if half else contextlib.nullcontext()
    with torch.no_grad(), autocast:
        v = velocity(policy.transformer, x, torch.tensor(sigmas, device=device), pe, pooled,
                     torch.float16 if half else torch.float32)
    return v.float()


def gpu_policy(compiled: bool, *overrides: str):
    """tiny_policy's counterpart on the GPU: fp16 base, on cuda, the blocks compiled if asked."""
    import types

    from hpcnft.algo.root_config import load_config

    cfg = load_config("tiny", list(overrides))
    tr = tiny_lora_dit(cfg, base_dtype=torch.float16).eval().to("cuda")
    if compiled:
        compiling.compile_blocks(tr, list(tr.transformer_blocks))
    return types.SimpleNamespace(cfg=cfg, transformer=tr)


class RecordOps(TorchDispatchMode):
    """Records the name of every aten (or custom) op run inside it ("aten::gelu",
    "hpcnft::gelu_quantize_rows"), in order: `with RecordOps() as ops: ...`, then `ops.names`;
    `ops.grad[i]` says whether grad mode was on when op i ran (off in no-grad passes)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []
        self.grad: list[bool] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        self.grad.append(torch.is_grad_enabled())
        return func(*args, **(kwargs or {}))
