"""Flow-GRPO's train step: the shared transition trainer (hpcnft.algo.transition_trainer) over
the first K recorded transitions of each sample, with the keys of `[grpo]` and its metrics
train/grpo_*."""
from __future__ import annotations

from hpcnft.algo.transition_trainer import SDEBatch as GRPOBatch  # noqa: F401 - what its trainer is given
from hpcnft.algo.transition_trainer import TransitionTrainer


class GRPOTrainer(TransitionTrainer):
    def __init__(self, cfg, policy, train_group, num_train_ranks: int):
        super().__init__(cfg, policy, train_group, num_train_ranks, cfg.grpo, "grpo")
