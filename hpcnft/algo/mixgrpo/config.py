"""The `[mixgrpo]` section, beside the MixGRPO math (hpcnft.algo.mixgrpo.formulas): its keys with
the names and defaults of the authors' FLUX.1-dev script (scripts/finetune/
finetune_flux_grpo_MixGRPO.sh) in parentheses. Imports nothing but common."""
from __future__ import annotations

from dataclasses import dataclass

from hpcnft.common.config import setting


@dataclass
class MixGRPOConfig:
    noise_level: float = setting(0.7, "a, the SDE's noise level inside the window: std_dev_t = a √(σ / (1 − σ)) (eta)",
                                 bound="> 0")
    window_size: int = setting(4, "the window: this many sampler steps of each rollout are sampled with the SDE and "
                                  "trained, the others follow the ODE (group_size)", bound="> 0")
    window_every: int = setting(25, "training steps before the window moves (iters_per_group)", bound="> 0")
    window_stride: int = setting(1, "sampler steps the window moves by (prog_overlap_step)", bound="> 0")
    window_roll_back: bool = setting(True, "the window goes back to the first sampler step once it has passed the "
                                           "last but one; else it stays there (roll_back)")
    clip_range: float = setting(1e-4, "ε of the clipped importance ratio, clamp(ratio, 1 − ε, 1 + ε) (clip_range)",
                                bound="> 0")
    adv_clip_max: float = setting(5.0, "advantage clip C: A within [−C, C] (adv_clip_max)", bound="> 0")
    updates_per_step: int = setting(2, "optimizer steps per rollout, each on one of every U consecutive samples (a "
                                       "seeded draw); the authors' script makes 4 (12 samples a GPU, gradients "
                                       "accumulated over 3)", bound="> 0")
