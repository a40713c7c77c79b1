"""DiffusionNFT math (nft_spec.md §1), as pure functions of tensors.

Notation: N = P*G samples per step, K trained sigmas per sample, a "pair" is (sample, sigma).
v_theta is the trained policy's velocity, v_old the old policy's (EMA, no gradient).
"""
from __future__ import annotations

import torch

from hpcnft.algo.nft.config import ADV_MODES
from hpcnft.algo.shared_math import prompt_groups
from hpcnft.common.determinism import stable_hash

WEIGHT_FLOOR = 1e-5
STD_EPS = 1e-4


def advantages(rewards: torch.Tensor, group_size: int, std_estimator: str = "unbiased",
               prompts: list[str] | None = None) -> torch.Tensor:
    """A_i = (R_i - mean of its prompt group) / (std over all N rewards + 1e-4).

    Rewards are ordered by global sample index, so consecutive `group_size` entries share a prompt
    (nft.group_by="position"). Given `prompts` (each sample's text; nft.group_by="prompt", as the
    official stat tracker), a group is every sample of one text, so a prompt a step holds twice
    forms one group. "unbiased" divides by N-1 (miles), "population" by N (official)."""
    r = rewards.to(torch.float64)
    std = r.std(unbiased=(std_estimator == "unbiased"))
    if prompts is None:
        group_mean = r.view(-1, group_size).mean(dim=1, keepdim=True)
        return ((r.view(-1, group_size) - group_mean) / (std + STD_EPS)).reshape(-1)
    if len(prompts) != r.numel():
        raise ValueError(f"advantages: {len(prompts)} prompts for {r.numel()} rewards")
    out = torch.empty_like(r)
    for index in prompt_groups(prompts):
        out[index] = (r[index] - r[index].mean()) / (std + STD_EPS)
    return out



def optimality_r(adv: torch.Tensor, clip_max: float, mode: str = "all") -> torch.Tensor:
    """r = clamp(a / C / 2 + 1/2, 0, 1) with a = clamp(A, -C, C): A=-C -> 0, A=0 -> 0.5, A=+C -> 1.

    `mode` (nft.adv_mode, the official variants) reshapes the clipped a first: "positive_only"
    keeps a >= 0 (the rest 0), "negative_only" a <= 0, "one_only" is 1 where a > 0 and 0 elsewhere,
    "binary" the sign of a."""
    a = adv.clamp(-clip_max, clip_max)
    if mode == "positive_only":
        a = a.clamp(0, clip_max)
    elif mode == "negative_only":
        a = a.clamp(-clip_max, 0)
    elif mode == "one_only":
        a = torch.where(a > 0, torch.ones_like(a), torch.zeros_like(a))
    elif mode == "binary":
        a = torch.sign(a)
    elif mode != "all":
        raise ValueError(f"nft.adv_mode: {mode!r} is not one of {', '.join(ADV_MODES)}")
    return (a / clip_max / 2 + 0.5).clamp(0.0, 1.0)


def trained_sigma_indices(num_steps: int, k: int, strategy: str, shuffle: bool, seed: int,
                          sample_index: int) -> list[int]:
    """Which rollout-grid sigmas (indices into the grid without its terminal 0) a sample trains on.

    "first": the first K of the grid (sigma_0..sigma_{K-1}; miles), order permuted per sample when
    `shuffle`. "random_per_sample" (or its older name "drop_random"): the first K of a per-sample
    permutation of all T steps, i.e. K of the T drawn without replacement, in random order
    (official: torch.randperm(T) per sample, the first K trained). K is the config's trained_steps."""
    g = torch.Generator().manual_seed(stable_hash("nft_sigma_shuffle", seed, sample_index))
    if strategy in ("random_per_sample", "drop_random"):
        return torch.randperm(num_steps, generator=g)[:k].tolist()
    if not shuffle:
        return list(range(k))
    return torch.randperm(k, generator=g).tolist()


def corrupt(x0: torch.Tensor, sigma: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Linear flow x_sigma = (1 - sigma) x0 + sigma eps, in fp32; sigma has shape [B]."""
    s = sigma.to(torch.float32).view(-1, *([1] * (x0.dim() - 1)))
    return (1 - s) * x0.to(torch.float32) + s * noise.to(torch.float32)


def implicit_policies(v_theta: torch.Tensor, v_old: torch.Tensor, beta: float):
    """v+ = beta v_theta + (1-beta) v_old ; v- = (1+beta) v_old - beta v_theta."""
    if beta == 1.0:  # exact: keeps v+ == v- bit for bit when v_theta == v_old
        return v_theta, 2 * v_old - v_theta
    return beta * v_theta + (1 - beta) * v_old, (1 + beta) * v_old - beta * v_theta


def _per_sample_mean(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(1).mean(dim=1)


def _squared(x: torch.Tensor) -> torch.Tensor:
    """x * x: the same values and gradient bits as x.square(), whose backward (pow's) copies its
    exponent from the host to the device at every call, a wait for the GPU to drain."""
    return x * x


def branch_loss(x_sigma: torch.Tensor, x0: torch.Tensor, sigma: torch.Tensor, v: torch.Tensor,
                adaptive: bool) -> torch.Tensor:
    """Per-pair L = mean_CHW (x0_hat - x0)^2 / w with x0_hat = x_sigma - sigma v and
    w = max(mean_CHW |x0_hat - x0|, 1e-5) computed in float64 without gradient."""
    s = sigma.to(torch.float32).view(-1, *([1] * (x0.dim() - 1)))
    err = (x_sigma - s * v.to(torch.float32)) - x0.to(torch.float32)
    mse = _per_sample_mean(_squared(err))
    if not adaptive:
        return mse
    with torch.no_grad():
        w = _per_sample_mean(err.detach().to(torch.float64).abs()).clamp_min(WEIGHT_FLOOR)
    return mse / w.to(mse.dtype)


def pair_loss(loss_pos: torch.Tensor, loss_neg: torch.Tensor, r: torch.Tensor, clip_max: float,
              beta: float) -> torch.Tensor:
    """l = C [r L+ + (1 - r) L-] / beta."""
    r = r.to(loss_pos.dtype)
    return clip_max * (r * loss_pos + (1 - r) * loss_neg) / beta


def kl_to_reference(v_theta: torch.Tensor, v_ref: torch.Tensor) -> torch.Tensor:
    """Per-pair mean_CHW (v_theta - v_ref)^2 (official's KL term to the frozen base)."""
    return _per_sample_mean(_squared(v_theta.to(torch.float32) - v_ref.to(torch.float32)))


def ema_decay(k: int, ramp: float, max_decay: float, flat_steps: int = 0, flat_decay: float = 0.0) -> float:
    """Old-policy decay after k optimizer steps: min(ramp (k - flat), max), flat_decay before."""
    if k <= flat_steps:
        return flat_decay
    return min(ramp * (k - flat_steps), max_decay)
