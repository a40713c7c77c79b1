"""The `[nft]` section, beside the NFT math (hpcnft.algo.nft.formulas, which takes ADV_MODES from here), with
the vocabularies of its choices. Imports nothing but common: the NFT math stays free of
processes and files."""
from __future__ import annotations

from dataclasses import dataclass

from hpcnft.common.config import setting

# nft.timestep_strategy: "drop_random" is random_per_sample's older name (the same draws)
TIMESTEP_STRATEGIES = ("first", "random_per_sample", "drop_random")
GROUPINGS = ("position", "prompt")
ADV_MODES = ("all", "positive_only", "negative_only", "one_only", "binary")
STD_ESTIMATORS = ("unbiased", "population")


@dataclass
class NFTConfig:
    beta: float = setting(1.0, "NFT strength β (v± = v_old ± β (v_θ − v_old))", bound="> 0")
    adv_clip_max: float = setting(5.0, "advantage clip C", bound="> 0")
    timestep_fraction: float = setting(0.99, "K = int(rollout.num_steps × fraction) σ trained per sample",
                                       bound="[0, 1]")
    timestep_strategy: str = setting(
        "first", "which σ are trained: `first` K (miles), or `random_per_sample`: K of the T drawn per sample "
        "(official; `drop_random` is its older name, the same draws)", choices=TIMESTEP_STRATEGIES)
    shuffle_timesteps: bool = setting(True, "shuffle the order of the trained σ")
    adaptive_weight: bool = setting(True, "the loss's adaptive normalisation")
    std_estimator: str = setting("unbiased", "the reward std of the advantages: `unbiased` (miles, N−1) or "
                                             "`population` (official, N)", choices=STD_ESTIMATORS)
    kl_beta: float = setting(0.0, "KL to the frozen base model (official: 1e-4)", bound=">= 0")
    group_by: str = setting("position", "advantage groups: `position` (G consecutive samples) or `prompt` (every "
                                        "sample of one prompt text, official)", choices=GROUPINGS)
    adv_mode: str = setting(
        "all", "`all` (miles), or the official variants on the clipped advantage: `positive_only`, `negative_only`, "
        "`one_only` (1 if A > 0 else 0), `binary` (sign of A)", choices=ADV_MODES)
