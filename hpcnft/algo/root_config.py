"""The job's config: the root that assembles every package's section, its few keys of its own
(`steps`, `run_dir`, `umask`), the checks across sections, and `load_config` (a recipe, then
`--set` overrides) and `config_from_dict` (a run file's or checkpoint's copy).

It sits in algo, the highest layer below both users, the job (hpcnft.run) and the benchmark
(hpcnft.bench), which may not import each other; every section is algo's or a lower layer's.
The machinery (TOML, `--set`, the per-key rules) is hpcnft.common.config's and
hpcnft.common.validation's; each section, with the vocabulary its choices come from, is beside
its owner:

  [models]                                   hpcnft.models.config
  [data] [checkpoint] [logging]              hpcnft.io.config
  [rollout] [train] [optim] [ema] [eval]     hpcnft.algo.config
  [nft]                                      hpcnft.algo.nft_config
  [reward] [[reward.terms]]                  hpcnft.rewards.config
  [layout] [preempt]                         hpcnft.distributed.config
  [determinism]                              hpcnft.common.config
  [perf]                                     hpcnft.perf.config
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass

from hpcnft.algo.config import EMAConfig, EvalConfig, OptimConfig, RolloutConfig, TrainConfig
from hpcnft.algo.nft_config import NFTConfig
from hpcnft.common import config as machinery
from hpcnft.common.config import DeterminismConfig, section, setting
from hpcnft.common.errors import ConfigError
from hpcnft.distributed.config import LayoutConfig, PreemptConfig
from hpcnft.io.config import CheckpointConfig, DataConfig, LoggingConfig
from hpcnft.models.config import FLUX_MAX_SEQUENCE_LENGTH, ModelsConfig
from hpcnft.perf.config import SD3_ONLY_LEVERS, PerfConfig
from hpcnft.rewards.config import RewardConfig

__all__ = ["Config", "ConfigError", "config_from_dict", "load_config"]


@dataclass
class Config:
    steps: int = setting(100, "run until this step", bound="> 0")
    run_dir: str = setting("", "the run's folder (`--run-dir`); empty: `runs/<recipe>-<date>-<time>`")
    umask: str = setting("077", "octal file-creation mask of every rank (run dir, run.h5, logs, checkpoints)")
    models: ModelsConfig = section(ModelsConfig)
    data: DataConfig = section(DataConfig)
    rollout: RolloutConfig = section(RolloutConfig)
    reward: RewardConfig = section(RewardConfig)
    nft: NFTConfig = section(NFTConfig)
    train: TrainConfig = section(TrainConfig)
    optim: OptimConfig = section(OptimConfig)
    ema: EMAConfig = section(EMAConfig)
    eval: EvalConfig = section(EvalConfig)
    checkpoint: CheckpointConfig = section(CheckpointConfig)
    layout: LayoutConfig = section(LayoutConfig)
    determinism: DeterminismConfig = section(DeterminismConfig)
    preempt: PreemptConfig = section(PreemptConfig)
    logging: LoggingConfig = section(LoggingConfig)
    perf: PerfConfig = section(PerfConfig)

    # -- derived ----------------------------------------------------------------------
    @property
    def samples_per_step(self) -> int:
        return self.rollout.prompts_per_step * self.rollout.samples_per_prompt

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def check(self) -> None:
        """The checks across sections (hpcnft.common.validation.check calls it after the keys' own
        rules and each section's checks)."""
        if not re.fullmatch(r"0?[0-7]{3}", self.umask):
            raise ConfigError(f"umask: expected an octal mask such as \"077\" or \"027\", got {self.umask!r}")
        r = self.rollout
        if int(r.num_steps * self.nft.timestep_fraction) < 1:
            raise ConfigError("nft.timestep_fraction: trains no sigma at rollout.num_steps "
                              f"{r.num_steps} (needs num_steps * fraction >= 1)")
        if self.perf.fused_lora and self.train.finetune != "lora":
            raise ConfigError("perf.fused_lora: needs train.finetune=\"lora\"")
        family = self.models.family
        if family != "sd3":
            for lever in SD3_ONLY_LEVERS:
                if getattr(self.perf, lever):
                    raise ConfigError(f"perf.{lever}: works on SD3's blocks only, not with models.family={family!r}")
        if family == "flux" and self.perf.attention_backend == "cudnn":
            raise ConfigError("perf.attention_backend: cuDNN's attention backward fails at FLUX.1's shapes "
                              "(models.family=\"flux\"); use flash, efficient or default")
        if family == "flux" and r.max_sequence_length > FLUX_MAX_SEQUENCE_LENGTH:
            raise ConfigError(f"rollout.max_sequence_length: FLUX's T5 takes at most {FLUX_MAX_SEQUENCE_LENGTH} "
                              f"tokens, got {r.max_sequence_length}")
        if self.perf.fuse_qkv and self.train.finetune == "lora" and not self.perf.merge_lora_nograd:
            raise ConfigError("perf.fuse_qkv: with train.finetune=\"lora\" it needs perf.merge_lora_nograd=true "
                              "(the fused projections hold the merged weights)")


def load_config(recipe: str = "tiny", overrides: list[str] | None = None, *, steps: int | None = None,
                run_dir: str | None = None) -> Config:
    return machinery.load(Config, recipe, overrides, steps=steps, run_dir=run_dir)


def config_from_dict(data: dict) -> Config:
    return machinery.from_dict(Config, data)


def reference_table() -> str:
    """docs/configuration.md's table of every key: its value in the tiny recipe, its meaning."""
    return machinery.reference_table(load_config("tiny"), "default (tiny)")
