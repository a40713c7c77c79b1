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
  [algo] [rollout] [train] [optim] [ema] [eval]  hpcnft.algo.config
  each algorithm's own ([nft], [grpo], ...)   its folder's config.py, through hpcnft.algo.registry
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

from hpcnft.algo.config import (AlgoConfig, EMAConfig, EvalConfig, OptimConfig, RolloutConfig, TrainConfig,
                                WatchConfig)
from hpcnft.algo.registry import spec_of, specs
from hpcnft.common import config as machinery
from hpcnft.common.config import DeterminismConfig, section, setting
from hpcnft.common.errors import ConfigError
from hpcnft.distributed.config import LayoutConfig, PreemptConfig
from hpcnft.io.config import CheckpointConfig, DataConfig, LoggingConfig
from hpcnft.models.config import FLUX_MAX_SEQUENCE_LENGTH, QWEN_IMAGE_MAX_SEQUENCE_LENGTH, ModelsConfig
from hpcnft.perf.config import BASE_WEIGHT_LEVERS, SD3_ONLY_LEVERS, PerfConfig
from hpcnft.rewards.config import RewardConfig

__all__ = ["Config", "ConfigError", "config_from_dict", "load_config"]


class Config:
    steps: int = setting(100, "run until this step", bound="> 0", on_resume="free")
    run_dir: str = setting("", "the run's folder (`--run-dir`); empty: `runs/<recipe>-<date>-<time>`", on_resume="free")
    umask: str = setting("077", "octal file-creation mask of every rank (run dir, run.h5, logs, checkpoints)",
                         on_resume="free")
    algo: AlgoConfig = section(AlgoConfig)
    models: ModelsConfig = section(ModelsConfig)
    data: DataConfig = section(DataConfig)
    rollout: RolloutConfig = section(RolloutConfig)
    reward: RewardConfig = section(RewardConfig)
    train: TrainConfig = section(TrainConfig)
    optim: OptimConfig = section(OptimConfig)
    ema: EMAConfig = section(EMAConfig)
    eval: EvalConfig = section(EvalConfig)
    watch: WatchConfig = section(WatchConfig)
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

    @property
    def rank_sample_parts(self) -> int:
        """The equal parts each train rank's samples of a step split into (the algorithm's optimizer
        updates per rollout, every train rank taking part in each with as many samples)."""
        return spec_of(self.algo.name).rank_sample_parts(self)

    @property
    def trained_steps(self) -> int:
        """K, the sampler steps each sample is trained at: the algorithm's timestep_fraction of them
        (int(T fraction), as train_sd3.py's train_timesteps and DiffusionNFT's). The one count of it."""
        return spec_of(self.algo.name).trained_steps(self)

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
        self.check_algorithm()
        if self.trained_steps < 1:
            raise ConfigError(f"{spec_of(self.algo.name).section}.timestep_fraction: trains no sigma at "
                              f"rollout.num_steps {r.num_steps} (needs num_steps * fraction >= 1)")
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
        if family == "qwen_image" and self.perf.attention_backend == "flash":
            raise ConfigError("perf.attention_backend: flash attention takes no mask, and Qwen-Image's DiT masks the "
                              "text padding (models.family=\"qwen_image\"); use efficient, cudnn, math or default")
        if family == "qwen_image" and r.max_sequence_length > QWEN_IMAGE_MAX_SEQUENCE_LENGTH:
            raise ConfigError(f"rollout.max_sequence_length: Qwen-Image's text encoder takes at most "
                              f"{QWEN_IMAGE_MAX_SEQUENCE_LENGTH} tokens, got {r.max_sequence_length}")
        if family == "wan" and r.num_frames % 4 != 1:
            raise ConfigError(f"rollout.num_frames: Wan's VAE takes 1 + 4k frames (1, 5, 9, ..., 33, 81), "
                              f"got {r.num_frames}")
        if family != "wan" and r.num_frames != 1:
            raise ConfigError(f"rollout.num_frames: models.family={family!r} makes images; frames need "
                              f"models.family=\"wan\", got {r.num_frames}")
        if self.perf.base_fp8_storage:
            self.check_fp8_storage()
        if self.perf.replicate_frozen_base and self.train.finetune != "lora":
            raise ConfigError("perf.replicate_frozen_base: keeps a LoRA run's frozen base whole; train.finetune is "
                              f"{self.train.finetune!r}")
        if self.perf.replicate_frozen_base and self.perf.fsdp_cpu_offload:
            raise ConfigError("perf.replicate_frozen_base: keeps the frozen base whole on the GPU, which "
                              "perf.fsdp_cpu_offload moves to CPU memory; set one of them to false")
        self.check_remote_wait()
        if self.determinism.layout_invariant:
            self.check_layout_invariant()
        self.check_watched_metrics()
        if self.perf.fuse_qkv and self.train.finetune == "lora" and not self.perf.merge_lora_nograd:
            raise ConfigError("perf.fuse_qkv: with train.finetune=\"lora\" it needs perf.merge_lora_nograd=true "
                              "(the fused projections hold the merged weights)")

    def check_watched_metrics(self) -> None:
        """watch.guard_metric and checkpoint.keep_best name an evaluation metric this run writes:
        eval/<term>_mean or _std of an evaluated term, or eval/drift."""
        names = [t.name or t.kind for t in self.reward.terms] or ["pickscore"]  # every term is evaluated
        written = {f"eval/{n}_{s}" for n in names for s in ("mean", "std")}
        if self.watch.drift_sigmas:
            written.add("eval/drift")
        for key, value in (("watch.guard_metric", self.watch.guard_metric), ("checkpoint.keep_best",
                                                                            self.checkpoint.keep_best)):
            if value and value not in written:
                raise ConfigError(f"{key}: {value!r} is not an evaluation metric of this run; it writes "
                                  f"{', '.join(sorted(written))}")

    def check_layout_invariant(self) -> None:
        """What determinism.layout_invariant needs: LoRA (the shards' gradients are gathered whole),
        an algorithm whose trainer sums shards (DiffusionNFT), and shards that split the step."""
        shards = self.determinism.virtual_shards
        if self.train.finetune != "lora":
            raise ConfigError("determinism.layout_invariant: gathers every shard's gradient whole, which a full "
                              "fine-tune's would make V x the DiT's size per rank; it needs train.finetune=\"lora\"")
        spec = spec_of(self.algo.name)
        if not spec.sums_virtual_shards:
            able = ", ".join(s.name for s in specs() if s.sums_virtual_shards)
            raise ConfigError(f"determinism.layout_invariant: {spec.title}'s trainer does not sum virtual shards "
                              f"(algo.name={self.algo.name!r}); algo.name may be: {able}")
        if self.samples_per_step % shards:
            raise ConfigError(f"determinism.virtual_shards: {shards} shards do not split the step's "
                              f"{self.samples_per_step} samples evenly")

    def check_remote_wait(self) -> None:
        """A remote term's wait for its server must end before the train ranks stop waiting for
        the chunk's scores (layout.timeout_s), so that the job, not a timeout, decides the end."""
        wait = self.reward.remote_wait_s()
        if wait and wait >= self.layout.timeout_s:
            remote = [i for i, t in enumerate(self.reward.terms) if t.kind == "remote"]
            key = f"reward.terms[{remote[0]}].retry_for_s" if len(remote) == 1 else "reward.terms[].retry_for_s"
            raise ConfigError(f"{key}: the remote terms may take {wait:g} s over a chunk (timeout_s + retry_for_s), "
                              f"not less than layout.timeout_s ({self.layout.timeout_s:g} s), which the train ranks "
                              "wait for its scores: lower retry_for_s or raise layout.timeout_s")

    def check_fp8_storage(self) -> None:
        """perf.base_fp8_storage stores a frozen base: refused for a full fine-tune and beside the
        levers that read or rewrite the base weights in half precision."""
        if self.train.finetune != "lora":
            raise ConfigError("perf.base_fp8_storage: stores the frozen base of a LoRA run; train.finetune is "
                              f"{self.train.finetune!r}")
        for lever in BASE_WEIGHT_LEVERS:
            if getattr(self.perf, lever):
                raise ConfigError(f"perf.base_fp8_storage: not with perf.{lever}, which reads the base weights in "
                                  "half precision; set one of them to false")

    def check_algorithm(self) -> None:
        """The keys only another algorithm reads are refused (set away from their defaults), then
        the algorithm's own checks."""
        spec = spec_of(self.algo.name)
        mine = {spec.section, *spec.owns}
        for other in (s for s in specs() if s is not spec):
            for key, why in other.changed_keys(self):
                if key.partition(".")[0] not in mine:
                    raise ConfigError(f"{key}: {why}, but algo.name is {self.algo.name!r}")
        spec.check(self)


def _with_algorithm_sections(cls):
    """The dataclass of `cls` with each registered algorithm's section after [algo]."""
    fields = {}
    for name, typ in cls.__annotations__.items():
        fields[name] = typ
        if name == "algo":
            for spec in specs():
                fields[spec.section] = spec.config
                setattr(cls, spec.section, section(spec.config))
    cls.__annotations__ = fields
    return dataclass(cls)


Config = _with_algorithm_sections(Config)


def load_config(recipe: str = "tiny", overrides: list[str] | None = None, *, steps: int | None = None,
                run_dir: str | None = None) -> Config:
    return machinery.load(Config, recipe, overrides, steps=steps, run_dir=run_dir)


def config_from_dict(data: dict) -> Config:
    return machinery.from_dict(Config, data)


def reference_table() -> str:
    """docs/configuration.md's table of every key: its value in the tiny recipe, its meaning."""
    return machinery.reference_table(load_config("tiny"), "default (tiny)")
