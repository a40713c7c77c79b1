"""The math of the algorithms that sample the flow ODE's SDE twin and train on the transitions
their rollouts recorded (Flow-GRPO, MixGRPO), as pure functions of tensors: one transition and its
log-probability (Flow-GRPO's sde_step_with_logprob, which MixGRPO's sampling takes too), PPO's clipped
objective on the ratio of the policy's log-probability to the recorded one, the KL between two
transitions' Gaussians, and which of a step's updates a sample trains in.

Notation: sigma runs from 1 (noise) to 0 (data) on the sampler's grid; dt = sigma_{k+1} - sigma_k < 0;
a = the noise level; a "pair" is (sample, transition k)."""
from __future__ import annotations

import math

import torch

from hpcnft.common.determinism import stable_hash


def _column(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A 0-dim or [B] tensor shaped to broadcast over `like` ([B, C, H, W]): [B or 1, 1, 1, 1]."""
    return t.reshape(-1, *([1] * (like.dim() - 1)))


def sde_step(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor, sigma_max: float,
             noise_level: float, noise: torch.Tensor | None = None, prev_sample: torch.Tensor | None = None):
    """One SDE transition from sigma to sigma_next (0-dim or [B] tensors) with the velocity v at x:

        std_dev_t = a sqrt(sigma / (1 - sigma))   (sigma = 1 counts as sigma_max, the grid's second value)
        mean      = x (1 + std_dev_t^2 dt / (2 sigma)) + v (1 + std_dev_t^2 (1 - sigma) / (2 sigma)) dt
        x_next    = mean + std_dev_t sqrt(-dt) noise              (unless prev_sample is given)
        log_prob  = mean over C, H, W of the Gaussian log-density of x_next, per sample

    Returns (x_next, log_prob [B], mean, std_dev_t); everything in float32."""
    v, x = v.float(), x.float()
    if prev_sample is not None:
        prev_sample = prev_sample.float()
    sigma, sigma_next = _column(sigma, x), _column(sigma_next, x)
    dt = sigma_next - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
    prev_sample_mean = (x * (1 + std_dev_t ** 2 / (2 * sigma) * dt)
                        + v * (1 + std_dev_t ** 2 * (1 - sigma) / (2 * sigma)) * dt)
    if prev_sample is None:
        prev_sample = prev_sample_mean + std_dev_t * torch.sqrt(-1 * dt) * noise.float()
    log_prob = (-((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
                - torch.log(std_dev_t * torch.sqrt(-1 * dt))
                - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi))))
    return prev_sample, log_prob.mean(dim=tuple(range(1, log_prob.ndim))), prev_sample_mean, std_dev_t


def clipped_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, adv: torch.Tensor, clip_range: float,
                 adv_clip_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair: max(-A ratio, -A clamp(ratio, 1 - eps, 1 + eps)) with ratio = exp(log pi_theta - log pi_old)
    and A clipped to [-C, C]. Returns (loss, ratio)."""
    a = torch.clamp(adv, -adv_clip_max, adv_clip_max)
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -a * ratio
    clipped = -a * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(unclipped, clipped), ratio


def kl_to_reference(mean: torch.Tensor, mean_ref: torch.Tensor, std_dev_t: torch.Tensor) -> torch.Tensor:
    """Per pair: mean over C, H, W of (mean - mean_ref)^2 / (2 std_dev_t^2), the KL between the two
    transitions' Gaussians (same std) per dimension."""
    kl = ((mean - mean_ref) ** 2).mean(dim=tuple(range(1, mean.ndim)), keepdim=True) / (2 * std_dev_t ** 2)
    return kl.reshape(-1)


def update_of(sample_ids: list[int], updates: int, seed: int, step: int) -> list[int]:
    """Which of a step's `updates` optimizer updates each sample trains in: the samples U b .. U b + U - 1
    go one to each update, in an order drawn per block b (seed, step): every update takes a random
    1/U of each prompt's samples, and of each train rank's (its samples are whole blocks)."""
    out = []
    for sid in sample_ids:
        block, j = divmod(sid, updates)
        g = torch.Generator().manual_seed(stable_hash("grpo_update_split", seed, step, block))
        out.append(int(torch.randperm(updates, generator=g)[j]))
    return out
