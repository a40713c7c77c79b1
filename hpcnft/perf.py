"""Throughput accounting for perf/* metrics: FLOPs counted by FlopCounterMode over real work,
against a matmul ceiling measured on this rank's device."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode


def matmul_ceiling(device: torch.device, dtype: torch.dtype) -> float:
    """Achieved FLOP/s of a large dense matmul here: the denominator of MFU."""
    n = 8192 if device.type == "cuda" else 1024
    dtype = dtype if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype, generator=None)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


@dataclass
class DitFlops:
    rollout_forward: float  # one sample, one sampler step
    train_pair: float  # v_old forward + v_theta forward + backward, one pair


def count_dit_flops(policy, latent_shape, prompt_embeds, pooled) -> DitFlops:
    """Count, on one sample, the DiT work a rollout step and a train pair do. Every train rank
    runs it together (FSDP2 collectives); the probe's gradients are dropped."""
    from hpcnft.sampler import velocity

    dev, dtype, tr = policy.device, policy.compute_dtype, policy.transformer
    x = torch.zeros((1, *latent_shape), device=dev)
    sigma = torch.full((1,), 0.5, device=dev)
    pe, pooled = prompt_embeds[:1].to(dev), pooled[:1].to(dev)
    with torch.no_grad(), policy.autocast(), FlopCount() as fwd:
        velocity(tr, x, sigma, pe, pooled, dtype)
    with policy.autocast(), FlopCount() as fwd_bwd:
        velocity(tr, x, sigma, pe, pooled, dtype).float().square().mean().backward()
    for p in policy.trainable:
        p.grad = None
    return DitFlops(rollout_forward=fwd.total, train_pair=fwd.total + fwd_bwd.total)


class FlopCount:
    """`with counter:` counts the FLOPs of everything inside (dispatch level, so backward too)."""

    def __init__(self):
        self.mode = FlopCounterMode(display=False)
        self.total = 0

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        self.total = self.mode.get_total_flops()
        return False


def mfu(flops: float, seconds: float, ceiling: float) -> float:
    return flops / max(seconds, 1e-12) / ceiling
