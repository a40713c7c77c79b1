"""MixGRPO math (Tencent-Hunyuan/MixGRPO: fastvideo/utils/grpo_states.py, fastvideo/utils/
sampling_utils.py, fastvideo/train_grpo_flux.py), as pure functions: where the SDE window is at a
training step, and the group advantages. The SDE transition, the clipped objective and the split
into updates are Flow-GRPO's (hpcnft.algo.sde_policy), as the authors' Flow-GRPO sampling takes.

Notation: T sampler steps, indices 0 .. T - 1; the window holds the steps sampled with the SDE and
trained, [start, min(start + size, T - 2)) (the authors' last window index is T - 2, excluded)."""
from __future__ import annotations

import torch

ADV_EPS = 1e-8  # train_one_step's group_std = group_rewards.std() + 1e-8


def window_start(step: int, num_steps: int, every: int, stride: int, roll_back: bool) -> int:
    """The window's first sampler step at training step `step` (1-based): GRPOTrainingStates'
    "progressive" strategy with overlap, which train_grpo_flux.py asks for its current steps and
    then advances once per training step. It moves by `stride` every `every` steps; past the last
    index (T - 2) it goes back to 0 (`roll_back`) or stays at T - 2."""
    last, start, iters = num_steps - 2, 0, 0
    for _ in range(step - 1):
        iters += 1
        if iters >= every:
            iters, start = 0, start + stride
        if start > last:
            start, iters = (0, 0) if roll_back else (last, iters)
    return start


def window_steps(start: int, num_steps: int, size: int) -> list[int]:
    """The sampler steps of the window that starts at `start`: empty where it starts at T - 2 (as
    the authors', a step that trains nothing)."""
    return list(range(start, min(start + size, num_steps - 2)))


def window(step: int, num_steps: int, size: int, every: int, stride: int, roll_back: bool) -> list[int]:
    """The sampler steps the rollout of `step` samples with the SDE and trains."""
    return window_steps(window_start(step, num_steps, every, stride, roll_back), num_steps, size)


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """train_one_step's advantages (use_group, one reward): each group of `group_size`
    consecutive samples (one prompt's), A = (R - the group's mean) / (the group's std (N - 1) +
    1e-8), in float64."""
    r = rewards.to(torch.float64).reshape(-1, group_size)
    return ((r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + ADV_EPS)).reshape(-1)
