"""Flow-GRPO math (Liu et al. 2025; yifan123/flow_grpo: flow_grpo/diffusers_patch/sd3_sde_with_logprob.py,
flow_grpo/stat_tracking.py, scripts/train_sd3.py), as pure functions of tensors.

The rollout samples the flow ODE's SDE twin: every step is a Gaussian transition x_k -> x_{k+1}
whose log-probability the rollout records (under the rollout policy, pi_old). Training recomputes
it under pi_theta for the first K transitions of each sample, and the loss is PPO's clipped
objective on the ratio of the two, with per-prompt group advantages and an optional KL to the
frozen base. The expressions and their order are the authors' (tests/flow_grpo_reference.py holds
a copy of their functions; tests/unit/algo/test_grpo.py checks these against it).

Notation: sigma runs from 1 (noise) to 0 (data) on the sampler's grid; dt = sigma_{k+1} - sigma_k < 0;
a = grpo.noise_level; a "pair" is (sample, transition k).
"""
from __future__ import annotations

import torch

# the transition, its objective and the split into updates are shared with the other algorithms that
# train on recorded SDE transitions (hpcnft.algo.sde_policy): Flow-GRPO's, as the authors write them
from hpcnft.algo.sde_policy import clipped_loss, kl_to_reference, sde_step, update_of  # noqa: F401
from hpcnft.algo.shared_math import prompt_groups

STD_EPS = 1e-4  # PerPromptStatTracker's


def group_advantages(rewards: torch.Tensor, prompts: list[str], global_std: bool = True) -> torch.Tensor:
    """PerPromptStatTracker's advantages, in float64: A_i = (R_i - mean of its prompt's rewards) / (std + 1e-4),
    the std (population, N) over every reward of the step (`global_std`) or over the prompt's own."""
    r = rewards.to(torch.float64)
    if len(prompts) != r.numel():
        raise ValueError(f"group_advantages: {len(prompts)} prompts for {r.numel()} rewards")
    out = torch.empty_like(r)
    for index in prompt_groups(prompts):
        std = r.std(unbiased=False) if global_std else r[index].std(unbiased=False)
        out[index] = (r[index] - r[index].mean()) / (std + STD_EPS)
    return out


def batch_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """The advantages with one sample per prompt (train_sd3.py turns the per-prompt tracker off
    then), in float64: A_i = (R_i - mean of every reward of the step) / (std (N) + 1e-4)."""
    r = rewards.to(torch.float64)
    return (r - r.mean()) / (r.std(unbiased=False) + STD_EPS)


def kept_per_update(adv: torch.Tensor, updates: int, seed: int, step: int) -> list[int]:
    """How many of the step's samples (all train ranks', `adv` in global order) each update
    trains on when the samples of advantage exactly 0 are left out (grpo.drop_zero_advantage)."""
    update = update_of(list(range(adv.numel())), updates, seed, step)
    kept = [0] * updates
    for u, a in zip(update, adv.tolist()):
        kept[u] += a != 0
    return kept
