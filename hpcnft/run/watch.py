"""The guard and the best checkpoint in a train job (hpcnft.run.guard decides): every train rank
observes each step's metrics alike and so stops alike; rank 0, which holds the run file, records
what they said and names the best checkpoint."""
from __future__ import annotations

import torch.distributed as dist

from hpcnft.run.guard import Guard, Verdict
from hpcnft.run.output import print_err


class JobWatch:
    def __init__(self, cfg):
        w, self.keep_best = cfg.watch, cfg.checkpoint.keep_best
        self.guard = Guard(w.guard_metric, w.guard_drop, self.keep_best) if w.guard_metric or self.keep_best else None
        self.stops = w.guard_action == "stop"

    def observe(self, step: int, metrics: dict) -> Verdict:
        return self.guard.observe(step, metrics) if self.guard is not None else Verdict()

    def halts(self, verdict: Verdict) -> bool:
        """Whether the verdict stops the run (watch.guard_action = "stop")."""
        return verdict.fired and self.stops

    def replay(self, writer, group, src: int, start_step: int) -> None:
        """Every train rank: the state the rows of run.h5 up to `start_step` left (rank 0, `src`,
        reads them), so that a resumed run decides as the uninterrupted one."""
        if self.guard is None or not start_step:
            return
        rows = [writer.rows_between(-1, start_step) if writer else None]
        if group is not None:
            dist.broadcast_object_list(rows, src=src, group=group)
        self.guard.replay(rows[0] or {})

    def record(self, writer, checkpointer, step: int, verdict: Verdict, saved: bool) -> None:
        """Rank 0: a new best (its checkpoint written at this step, named in checkpoints/BEST)
        and the guard's verdict, as events and a line."""
        if writer is None:
            return
        if verdict.new_best and saved:
            value = self.guard.kept.value
            checkpointer.mark_best(step, self.keep_best, value)
            writer.event(step, "best", f"best checkpoint by {self.keep_best}: step {step} ({value:.6g})")
        if verdict.fired:
            writer.event(step, "guard", verdict.text)
            print_err(verdict.text)
