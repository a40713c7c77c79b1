"""The DiT work (FLOPs) of one rollout step and one train pair, the numerators of the MFU metrics."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hpcnft.algo.sampler import velocity
from hpcnft.perf.mfu import FlopCount


@dataclass
class DitFlops:
    rollout_forward: float  # one sample, one sampler step
    train_pair: float  # v_old forward + v_theta forward + backward, one pair


def count_dit_flops(policy, latent_shape, prompt_embeds, pooled, guidance: float = 1.0) -> DitFlops:
    """Count, on one sample, the DiT work a rollout step and a train pair do. Every train rank
    runs it together (FSDP2 collectives); the probe's gradients are dropped."""
    dev, dtype, tr = policy.device, policy.compute_dtype, policy.transformer
    x = torch.zeros((1, *latent_shape), device=dev)
    sigma = torch.full((1,), 0.5, device=dev)
    pe, pooled = prompt_embeds[:1].to(dev), pooled[:1].to(dev)
    with torch.no_grad(), policy.autocast(), FlopCount() as fwd:
        velocity(tr, x, sigma, pe, pooled, dtype, guidance=guidance)
    with policy.autocast(), FlopCount() as fwd_bwd:
        velocity(tr, x, sigma, pe, pooled, dtype, guidance=guidance).float().square().mean().backward()
    for p in policy.trainable:
        p.grad = None
    return DitFlops(rollout_forward=fwd.total, train_pair=fwd.total + fwd_bwd.total)
