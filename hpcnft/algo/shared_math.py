"""The pure functions the iteration engine and every algorithm share: groups of samples by prompt
text, the rollout reward's statistics, the evaluation EMA's decay schedule."""
from __future__ import annotations

import torch


def prompt_groups(prompts: list[str]) -> list[torch.Tensor]:
    """The positions of each distinct prompt text, in order of first appearance: the groups
    whose statistics advantages are taken over (exact text)."""
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(p, []).append(i)
    return [torch.tensor(members) for members in groups.values()]


def eval_ema_decay(k: int, max_decay: float) -> float:
    """Decay of the evaluation EMA after optimizer step k (1-based): min((1 + k) / (10 + k), max),
    the official EMAModuleWrapper's warm-up."""
    return min((1 + k) / (10 + k), max_decay)


def reward_stats(rewards: torch.Tensor) -> dict[str, float]:
    """rollout/reward/raw_*: std with N (unbiased=False), median = lower middle (torch.median)."""
    r = rewards.to(torch.float64)
    return {"raw_mean": r.mean().item(), "raw_std": r.std(unbiased=False).item(), "raw_min": r.min().item(),
            "raw_max": r.max().item(), "raw_median": r.median().item(), "raw_num_samples": float(r.numel())}
