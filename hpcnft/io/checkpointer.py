"""The train ranks' checkpoints in one place: a Checkpointer owns the schedule (when a step is
checkpointed; how many are kept, pruned at each commit) and saves or loads the parts a
checkpoint is made of, in one fixed order. It is handed the trained state as Stateful parts by
name (hpcnft.algo.checkpoint_parts: each says what it holds) and reaches into none of them.

    part        where it goes (io.checkpoint's layout)        who writes it
    parts       DCP shards: trained weights, pi_old, the       every train rank (collective)
                evaluation EMA, the optimizer
    scaler      trainer_state.json                             rank 0's commit
    rng         rng/rank_<r>.bin: this rank's global RNGs      every train rank, its own
    peers       rng/rank_<r>.bin of the reward ranks           peers(step): each reward rank its own
    run_file    run_state.h5 (run.h5's copy) and run.h5's      rank 0, through its RunFileWriter
                RNG rows (every rank's rng file) and event

save(step): shards and this rank's RNG into step_XXXXXX.partial, the reward ranks' RNG, barrier;
rank 0 then writes run.h5's RNG rows, commits (scaler, config, run file copy, COMPLETE, rename,
prune) and writes the checkpoint event; barrier. A failed save leaves no .partial behind.
load(plan): shards, scaler and this rank's RNG from the plan's checkpoint; then, on rank 0 and
when the plan says so, run.h5 rebuilt from that checkpoint's copy (the old file set aside).

The reward ranks' side of the RNG files is restore_rank_rng / snapshot_rank_rng.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from hpcnft.common import determinism
from hpcnft.io import checkpoint, run_state


@dataclass
class Resumed:
    step: int = 0  # the step the run resumes after; 0: a fresh start
    path: str = ""  # the checkpoint loaded; "" when none
    rebuilt: str = ""  # rank 0: the warning that run.h5 was rebuilt from the checkpoint's copy; "" when not


def restore_rank_rng(ckpt_dir: str, rank: int) -> bool:
    """Restore this process's global RNGs from rank `rank`'s file in the checkpoint, if it has one."""
    blob = checkpoint.read_rng(ckpt_dir, rank)
    if blob is None:
        return False
    determinism.restore_rng_state(blob)
    return True


def snapshot_rank_rng(run_dir: str, step: int, rank: int) -> None:
    """Write this process's global RNG states as rank `rank`'s file into the checkpoint of `step`
    being written (a reward rank, asked by its train ranks during their save)."""
    checkpoint.write_rng(run_dir, step, rank, determinism.capture_rng_state())


@dataclass(frozen=True)
class Schedule:
    """When a step is checkpointed ([checkpoint]): every `every` steps (0: never on a count), at
    the run's last step when `at_end`; `keep` committed checkpoints are kept, older ones pruned."""
    every: int
    at_end: bool
    keep: int

    def due(self, step: int, last_step: int) -> bool:
        return bool((self.every and step % self.every == 0) or (step == last_step and self.at_end))


class Checkpointer:
    """A train rank's checkpoints. `group`: the train ranks' process group (None in a single
    process); `world_size`: every rank of the job, reward ranks included (their RNG files go into
    run.h5's rows); `parts`: the Stateful parts by checkpoint name; `peers(step)`: has the reward
    ranks write their RNG files into the partial checkpoint; `scaler`: anything with
    state_dict/load_state_dict (JSON-able). Rank 0 sets `run_file` (its RunFileWriter) once run.h5
    is open; `last` is the newest checkpoint loaded or committed here."""

    def __init__(self, run_dir: str, group, rank: int, world_size: int, config_json: str, schedule: Schedule, *,
                 parts: dict, scaler=None, peers: Callable[[int], None] | None = None):
        self.run_dir, self.group, self.rank, self.world_size = run_dir, group, rank, world_size
        self.config_json, self.schedule = config_json, schedule
        self.parts, self.scaler, self.peers = parts, scaler, peers
        self.run_file = None
        self.last = ""

    def due(self, step: int, last_step: int) -> bool:
        """Whether step `step` of a run to `last_step` is checkpointed on schedule."""
        return self.schedule.due(step, last_step)

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    # -- save -------------------------------------------------------------------------
    def save(self, step: int, rng_state: bytes | None = None) -> str:
        """Collective over the train ranks: checkpoint `step`, with this rank's RNG state as it
        is now, or `rng_state` (captured when step `step` ended: a step abandoned after it must
        not leave its draws in the checkpoint). Returns the committed checkpoint's path on rank
        0, "" on the other ranks."""
        is_writer = self.rank == 0
        final = ""
        try:
            tmp = checkpoint.save(self.run_dir, step, self.parts, self.group, is_writer, self.rank,
                                  rng_state if rng_state is not None else determinism.capture_rng_state())
            if self.peers is not None:
                self.peers(step)  # the reward ranks' RNG states, into the same checkpoint
            self._barrier()
            if is_writer:
                final = self.last = self._commit(tmp, step)
        except BaseException:
            if is_writer:  # a failed checkpoint leaves no .partial behind; older ones stay
                checkpoint.discard_partial(self.run_dir, step)
            raise
        self._barrier()
        return final

    def _commit(self, tmp: str, step: int) -> str:
        """Rank 0, every rank's files in place: run.h5's RNG rows, the commit (with run.h5's
        copy, which already holds the checkpoint event run.h5 gets right after), the event."""
        w = self.run_file
        if w is not None:
            states = {r: checkpoint.read_rng(tmp, r) for r in range(self.world_size)}
            w.write_rng(step, {r: b for r, b in states.items() if b is not None})
        state = checkpoint.TrainState(step, self.scaler.state_dict() if self.scaler is not None else {})
        final_name = checkpoint.step_dir(self.run_dir, step)
        copy = None if w is None else (lambda path: w.snapshot(path, (step, "checkpoint", final_name)))
        final = checkpoint.commit(self.run_dir, step, state, self.config_json, self.schedule.keep, copy)
        if w is not None:
            w.event(step, "checkpoint", final)
        return final

    def mark_best(self, step: int, metric: str, value: float) -> None:
        """Rank 0, checkpoint `step` committed: it is the best by `metric` (checkpoint.keep_best),
        kept beside the newest ones; the best before it is pruned as any older checkpoint."""
        checkpoint.write_best(self.run_dir, step, metric, value)
        checkpoint.prune(self.run_dir, self.schedule.keep)

    # -- load -------------------------------------------------------------------------
    def load(self, plan, on_loaded: Callable[[int, str], None] | None = None) -> Resumed:
        """Collective over the train ranks: load the checkpoint of `plan` (run.resume's
        ResumePlan, the same on every rank): shards, scaler, this rank's RNG; `on_loaded(step,
        path)` then; last, on rank 0, run.h5 rebuilt from the checkpoint's copy when the plan
        says it must be (before the file is opened)."""
        if plan.checkpoint is None:
            return Resumed(rebuilt=self._set_aside(plan) if self.rank == 0 and plan.aside_tag else "")
        step, path = plan.checkpoint
        state = checkpoint.load(path, self.parts, self.group)
        if self.scaler is not None:
            self.scaler.load_state_dict(state.scaler)
        restore_rank_rng(path, self.rank)
        self.last = path
        if on_loaded is not None:
            on_loaded(step, path)
        rebuilt = self._rebuild_run_file(plan, step, path) if self.rank == 0 and plan.rebuild_why else ""
        return Resumed(step, path, rebuilt)

    def _set_aside(self, plan) -> str:
        """No checkpoint to rebuild from: the unusable run.h5 is set aside (never deleted) and the
        run starts over with a new one; the warning that says so."""
        path = os.path.join(self.run_dir, "run.h5")
        aside = run_state.set_aside(path, plan.aside_tag)
        return f"{path} {plan.rebuild_why}: kept as {aside}; no checkpoint to resume from, the run starts over"

    def _rebuild_run_file(self, plan, step: int, ckpt: str) -> str:
        """Set the unusable run.h5 aside (never deleted) and write it anew from checkpoint
        `ckpt`'s copy; returns the warning that says so."""
        path = os.path.join(self.run_dir, "run.h5")
        aside = run_state.set_aside(path, plan.aside_tag) if os.path.lexists(path) else ""
        run_state.rebuild(path, ckpt)
        return (f"{path} {plan.rebuild_why}: rebuilt from checkpoint {ckpt} (rows up to step {step})"
                + (f"; the old file is kept as {aside}" if aside else ""))
