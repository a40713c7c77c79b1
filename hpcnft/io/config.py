"""The sections of what the job reads and writes: `[data]` (the prompt files, hpcnft.io.prompt_files),
`[checkpoint]` (hpcnft.io.checkpoint's schedule) and `[logging]` (sample grids and the live
trackers of hpcnft.io.trackers)."""
from __future__ import annotations

from dataclasses import dataclass

from hpcnft.common.config import setting
from hpcnft.common.errors import ConfigError

# The live trackers: name -> (the module it imports, the pip extra that installs it).
# hpcnft.io.trackers has one class for each.
TRACKERS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


@dataclass
class DataConfig:
    train_prompts: str = setting(
        "builtin:tiny_train_prompts.txt",
        "the training prompts: a text file, one prompt per line; `builtin:NAME` (hpcnft/data); `csv:PATH#COLUMN`, a "
        "column of a CSV (`.tsv`: tab-separated); `drawbench:PATH` or `drawbench:PATH#CATEGORY`, your copy of "
        "DrawBench (see [Evaluation prompts](recipes.md#evaluation-prompts-the-pickscore-test-split-and-drawbench))")
    eval_prompts: str = setting("builtin:tiny_eval_prompts.txt",
                                "the evaluation prompts, in the forms `data.train_prompts` takes")
    shuffle: bool = setting(False, "a seeded permutation of the training prompts per pass over the file "
                                   "(reference recipe: file order)")


@dataclass
class CheckpointConfig:
    every: int = setting(20, "a checkpoint every this many steps (0: only at the end and on preemption)", bound=">= 0",
                         on_resume="free")
    keep: int = setting(2, "the newest checkpoints kept (older ones are deleted)", bound="> 0", on_resume="free")
    at_end: bool = setting(True, "a checkpoint at the last step", on_resume="free")
    keep_best: str = setting("", "an evaluation metric (higher is better, e.g. a held-out judge's "
                                 "`eval/<term>_mean`): a new best checkpoints its step and keeps it beside the newest "
                                 "ones (`hpcnft export --checkpoint best`); empty: off", on_resume="free")


@dataclass
class LoggingConfig:
    sample_grid_every: int = setting(10, "a PNG grid of rollout images at step 1 and every this many steps (0: none)",
                                     bound=">= 0", on_resume="free")
    sample_grid_images: int = setting(16, "rollout images in each sample grid (0: no grid)", bound=">= 0",
                                      on_resume="free")
    trackers: list[str] = setting(
        [], "live trackers fed by rank 0, every metrics row and every sample grid: `[\"tensorboard\"]`, "
        "`[\"wandb\"]` or both (extras `hpcnft[tensorboard]`, `hpcnft[wandb]`); run.h5 stays the record, a failing "
        "tracker is dropped; may change on resume", on_resume="free")

    def check(self) -> None:
        for name in self.trackers:
            if name not in TRACKERS:
                raise ConfigError(f"logging.trackers: {name!r} is not one of {', '.join(TRACKERS)}")
            if self.trackers.count(name) > 1:
                raise ConfigError(f"logging.trackers: {name!r} is listed more than once")
