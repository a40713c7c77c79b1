"""MixGRPO's train step: the shared transition trainer (hpcnft.algo.transition_trainer) over the
window's recorded transitions, with the keys of `[mixgrpo]` (no KL term: the authors' script sets
kl_coeff 0) and its metrics train/mix_*, the window's first step among them."""
from __future__ import annotations

import torch

from hpcnft.algo.transition_trainer import SDEBatch, TransitionTrainer


class MixGRPOTrainer(TransitionTrainer):
    def __init__(self, cfg, policy, train_group, num_train_ranks: int):
        super().__init__(cfg, policy, train_group, num_train_ranks, cfg.mixgrpo, "mix")

    def step(self, batch: SDEBatch, sigmas: torch.Tensor, step: int) -> dict[str, float]:
        return {**super().step(batch, sigmas, step), "train/mix_window_start": float(batch.first)}
