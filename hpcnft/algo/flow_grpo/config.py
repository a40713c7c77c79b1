"""The `[grpo]` section, beside the Flow-GRPO math (hpcnft.algo.flow_grpo.formulas): its keys under the names
Flow-GRPO's own config gives them (yifan123/flow_grpo, config/base.py and config/grpo.py) where
they differ. Imports nothing but common: the math stays free of processes and files."""
from __future__ import annotations

from dataclasses import dataclass

from hpcnft.common.config import setting


@dataclass
class GRPOConfig:
    noise_level: float = setting(0.7, "a, the rollout SDE's noise level: std_dev_t = a √(σ / (1 − σ)) "
                                      "(Flow-GRPO's sample.noise_level)", bound="> 0")
    clip_range: float = setting(1e-4, "ε of the clipped importance ratio, clamp(ratio, 1 − ε, 1 + ε) "
                                      "(train.clip_range)", bound="> 0")
    adv_clip_max: float = setting(5.0, "advantage clip C: A within [−C, C] (train.adv_clip_max)", bound="> 0")
    kl_beta: float = setting(0.0, "KL to the frozen base: β mean_CHW (μ_θ − μ_ref)² / (2 std_dev_t²) per transition "
                                  "(train.beta; 0.01 in its SD3.5-M PickScore recipe); needs LoRA", bound=">= 0")
    timestep_fraction: float = setting(0.99, "K = int(rollout.num_steps × fraction): the first K SDE transitions of "
                                             "each sample are trained (train.timestep_fraction)", bound="[0, 1]")
    global_std: bool = setting(True, "advantages (R − the prompt's mean) over the std of every reward of the step "
                                     "(true) or of the prompt's own rewards (sample.global_std)")
    drop_zero_advantage: bool = setting(
        False, "leave the samples whose advantage is exactly 0 out of the loss and its mean (Flow-GRPO's mask of "
        "all-zero advantages; it re-admits a few at random to fill equal batches, hpcnft weights them 0 instead)")
    updates_per_step: int = setting(2, "optimizer steps per rollout, each on one of every U consecutive samples "
                                       "(a seeded draw); Flow-GRPO's recipes make 2 per epoch", bound="> 0")
