"""A train rank's job from start (or resume) to finish: its parts wired (run.train_rank), resume,
iterate, evaluate and checkpoint on schedule, stop on preemption and requeue, close the run file."""
from __future__ import annotations

import os
import time
from collections import Counter

import torch
import torch.distributed as dist

from hpcnft import __version__
from hpcnft.algo.checkpoint_parts import checkpoint_parts
from hpcnft.algo.prompts import pass_last_step, pass_of
from hpcnft.algo.reward import term_columns
from hpcnft.algo.root_config import Config
from hpcnft.common import collector, determinism
from hpcnft.common.disk import folder_bytes
from hpcnft.common.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_PREEMPTED, EXIT_UNAVAILABLE
from hpcnft.distributed.preempt import PreemptFlag, leave_requeue_to_slurm, requeue
from hpcnft.distributed.reward_service import RewardOutage, RewardServiceError
from hpcnft.io.checkpointer import Checkpointer, Schedule
from hpcnft.io.trackers import TrackerGroup
from hpcnft.rewards.registry import training_terms
from hpcnft.run.output import (claim_first_failure, eval_line, fail_line, log, pass_line, print_err, progress_line,
                               reward_header, save_grid, steps_text, truncation_warning)
from hpcnft.run.resume import ResumePlan, layout_change
from hpcnft.run.rundir import finished_line
from hpcnft.run.train_rank import build_train_rank
from hpcnft.run.watch import JobWatch


class TrainJob:
    """A train rank's run: resume, iterate, evaluate, checkpoint, stop on preemption."""

    def __init__(self, cfg: Config, topo, group, mesh, flag: PreemptFlag, plan: ResumePlan, resume: str = ""):
        self.cfg, self.topo, self.group, self.flag, self.plan = cfg, topo, group, flag, plan
        self.resume_command = resume  # what the user types to go on after a stop
        self.say("loading the models")
        t0 = time.perf_counter()
        self.tr = tr = build_train_rank(cfg, topo, group, mesh, self.say)
        collector.settle()
        self.say(f"models loaded in {time.perf_counter() - t0:.1f} s")
        if tr.policy.base_storage:
            self.say(tr.policy.base_storage)
        c = cfg.checkpoint
        self.checkpointer = Checkpointer(cfg.run_dir, group, topo.rank, topo.world_size, cfg.to_json(),
                                         Schedule(c.every, c.at_end, c.keep),
                                         parts=checkpoint_parts(tr.policy, tr.trainer.optimizer),
                                         scaler=tr.trainer.scaler, peers=tr.client.snapshot)
        self.watch = JobWatch(cfg)  # the guard and the best checkpoint, from the evaluations' metrics
        self.writer = None
        self.warnings: list[str] = []
        self.resumed_from = self.rebuilt = ""  # the checkpoint loaded; rank 0: the warning that run.h5 was rebuilt
        self.requeue_job = ""  # rank 0, preempted under Slurm: requeue this job once run.h5 is closed
        self.step = 0  # the step under way (0: before the first), for the step of an error event
        self.saved_step = 0  # the newest step with a checkpoint (0: none)
        self.latest_eval: tuple[int, dict] | None = None  # rank 0: (step, eval/* metrics) of the newest evaluation
        self.trackers = TrackerGroup([], self._warn)  # rank 0 opens the configured ones (open_trackers)
        self.kept_through = -1  # the last step whose rows earlier starts wrote as run.h5 still holds them

    def say(self, text: str) -> None:
        """What the user follows on the terminal: rank 0 prints it, every rank logs it."""
        log.info(text)
        if self.topo.rank == 0:
            print(f"hpcnft: {text}", flush=True)

    def _warn(self, text: str) -> None:
        log.warning(text)
        self.warnings.append(text)
        if self.topo.rank == 0:
            print_err(f"warning: {text}")

    def resume(self) -> int:
        """Every train rank: the plan's checkpoint loaded (rank 0's choice, on every rank:
        resume.agree_plan) and, on rank 0, run.h5 rebuilt from it if the plan says so."""
        for text in self.plan.warnings:
            self._warn(text)
        resumed = self.checkpointer.load(
            self.plan, lambda step, path: self.say(f"resuming after step {step} from checkpoint {path}"))
        self.resumed_from, self.rebuilt = resumed.path, resumed.rebuilt
        if resumed.rebuilt:
            self._report_warning(resumed.rebuilt)  # before run.h5 is open: its event follows once it is
        return resumed.step

    def open_run_file(self, start_step: int) -> None:
        from hpcnft.io.run_writer import RunFileWriter
        from hpcnft.io.runfile import EVAL_KEYS, reward_term_keys, watch_keys

        cfg, topo = self.cfg, self.topo
        cols = term_columns(cfg)
        term_keys = reward_term_keys([t.name for t in cols["rollout"]] if cfg.reward.terms else [],
                                     [t.name for t in cols["eval"]])
        term_keys += watch_keys(cfg.watch.diversity, bool(cfg.watch.drift_sigmas), cfg.train.finetune == "lora")
        spec = self.tr.algorithm.spec  # its train keys, its loss first, beside the shared keys
        w = self.writer = RunFileWriter(os.path.join(cfg.run_dir, "run.h5"), cfg.to_json(), __version__,
                                        (*spec.metric_keys, *term_keys), loss_key=spec.loss_key)
        self.checkpointer.run_file = w  # its copy, RNG rows and event go with every checkpoint
        last_topology = w.set_topology(topo.as_attrs())
        for text in self.warnings:  # the resume plan's: skipped checkpoints, changed keys
            w.event(start_step, "warning", text)
        if self.rebuilt:
            w.event(start_step, "warning", self.rebuilt)
        if start_step:
            # An eval that ran only because the earlier run ended at start_step is not one an
            # uninterrupted run would have: it goes, so both runs hold the same rows.
            periodic = cfg.eval.every and start_step % cfg.eval.every == 0
            eval_keys = EVAL_KEYS + [k for k in term_keys if k.startswith("eval/")]
            end_only = () if periodic or start_step >= cfg.steps else tuple(eval_keys)
            before = set(w.rows_between(start_step - 1, start_step).get(start_step, {}))
            dropped = w.truncate_after(start_step, inclusive_keys=end_only)
            # where rows of the resume step itself went, the trackers take that step again from run.h5
            kept = set(w.rows_between(start_step - 1, start_step).get(start_step, {}))
            self.kept_through = start_step if kept == before else start_step - 1
            w.drop_rng_after(start_step)
            w.event(start_step, "resume", f"resumed from {self.resumed_from}; dropped {dropped} metric rows "
                                          f"after step {start_step}")
            moved = layout_change(last_topology, topo.as_attrs())  # a requeue onto what the cluster had free
            if moved:
                self.say(moved)
                w.event(start_step, "layout", moved)
        else:
            w.truncate_after(-1)  # a run that died before its first checkpoint starts over
        w.add_attempt({"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "from_step": start_step,
                       "slurm_job_id": topo.job_id or "", "restart_count": topo.restart_count,
                       "launcher": topo.launcher, "world_size": topo.world_size,
                       "resumed_from": self.resumed_from})
        w.event(start_step, "start", f"{topo.launcher} launch, world {topo.world_size}, train ranks "
                                     f"{topo.train_ranks}, reward ranks {topo.reward_ranks or 'colocated'}")

    def open_trackers(self, start_step: int) -> None:
        """Rank 0: the live trackers of logging.trackers, continuing the curves of earlier starts."""
        cfg = self.cfg
        if not cfg.logging.trackers or start_step >= cfg.steps:
            return
        self.trackers = TrackerGroup.open(cfg.logging.trackers, cfg.run_dir, self.kept_through, cfg.to_dict(),
                                          self._report_warning)
        for tracker in self.trackers.trackers:
            self.say(f"live tracker: {tracker.where}")

        def grid_path(step: int) -> str | None:
            path = os.path.join(cfg.run_dir, "samples", f"step_{step:06d}.png")
            return path if os.path.isfile(path) else None
        self.trackers.backfill(start_step, self.writer.rows_between, grid_path)

    def _report_warning(self, text: str, step: int | None = None) -> None:
        """Rank 0: a warning to the log, the terminal and, once it is open, the run file (at
        `step`, else its last step)."""
        log.warning(text)
        print_err(f"warning: {text}")
        if self.writer:
            self.writer.event(self.writer.last_step() if step is None else step, "warning", text)

    def warn_truncated_prompts(self, step: int) -> None:
        """Rank 0, once per start: how many prompts the text encoders will cut."""
        text = truncation_warning(self.cfg, self.tr)
        if text:
            self._report_warning(text, step)

    def report_term_warnings(self, step: int) -> None:
        """Every train rank: the warnings the reward terms gave on this rank's chunks of the
        step (and of an evaluation before it) go to rank 0, which reports each text once, with
        how often it came, as a warning event of the step."""
        local = self.tr.client.take_warnings()
        if self.group is None:
            texts = local
        else:
            everyone: list = [None] * len(self.topo.train_ranks)
            dist.all_gather_object(everyone, local, group=self.group)
            texts = [text for part in everyone for text in part]
        if self.topo.rank == 0:
            for text, n in Counter(texts).items():
                self._report_warning(text if n == 1 else f"{text} (x{n})", step)

    def stop_requested(self) -> bool:
        """Every train rank's flag and the reward rank's, agreed at the end of an iteration."""
        local = torch.tensor([float(self.flag.requested or self.tr.client.peer_preempt)], device=self.topo.comm_device)
        if self.group is not None:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.group)
        return bool(local.item())

    def start(self) -> int:
        """Load the checkpoint (if any) and, on rank 0, open run.h5 and the trackers; the step
        the run resumes after."""
        cfg = self.cfg
        start_step = self.step = self.resume()
        if self.topo.rank == 0:
            self.open_run_file(start_step)
            self.warn_truncated_prompts(start_step)
            self.open_trackers(start_step)
            if start_step < cfg.steps:  # what the progress line's `reward` is
                self.say(reward_header(cfg.reward.scale, training_terms(cfg)))
        if cfg.eval.at_start and start_step == 0:
            before = self.tr.evaluate()
            self.log_row(0, before)
            self.watch.observe(0, before)  # the base's judgement: often the judge's best
            if self.writer:
                self.say_lines(self.learning_lines(0, before))
        self.saved_step = start_step
        self.watch.replay(self.writer, self.group, self.topo.train_ranks[0], start_step)
        if self.evaluation_owed(start_step):  # its reward service was down when it was due
            self.log_row(start_step, self.tr.evaluate())
        return start_step

    def guard_stop(self, step: int) -> int:
        """Every train rank: the guard's stop, after its checkpoint; the reward rank is told the
        run ended (not preempted: nothing requeues it)."""
        self.tr.client.finish(step)
        if self.writer:
            self.writer.event(step, "done", f"stopped by the guard at step {step}")
        if self.topo.rank == 0:
            then = f"; `{self.resume_command}` goes on" if self.resume_command else ""
            print(f"hpcnft: stopped by the guard at step {step}: checkpointed{then}", flush=True)
        return EXIT_OK

    def eval_due(self, step: int) -> bool:
        cfg = self.cfg
        return bool((cfg.eval.every and step % cfg.eval.every == 0) or (step == cfg.steps and cfg.eval.at_end))

    def evaluation_owed(self, start_step: int) -> bool:
        """Every train rank: whether the evaluation of the step resumed after was due but is not
        in run.h5 (a reward service stayed unreachable while it ran: outage()); rank 0 decides."""
        if not start_step or not self.eval_due(start_step):
            return False
        owed = [False]
        if self.writer:
            rows = self.writer.rows_between(start_step - 1, start_step).get(start_step, {})
            owed[0] = not any(key.startswith("eval/") for key in rows)
        if self.group is not None:
            dist.broadcast_object_list(owed, src=self.topo.train_ranks[0], group=self.group)
        return owed[0]

    def iterate(self, step: int):
        """Every train rank: one iteration, its evaluation when one is due, its sample grid
        when one is due; (metrics, grid or None, the RewardOutage that left the evaluation
        unmade or None). A RewardOutage of the rollout (nothing of the step done) is raised."""
        cfg, tr = self.cfg, self.tr
        metrics, ro = tr.iteration(step)
        lost = None
        if self.eval_due(step):
            try:
                metrics.update(tr.evaluate())
            except RewardOutage as e:  # the step is trained: it is kept, its evaluation owed
                lost = e
        every, n_grid = cfg.logging.sample_grid_every, cfg.logging.sample_grid_images
        grid = tr.grid_images(step, ro.images, n_grid) if every and n_grid and \
            (step % every == 0 or step == 1) else None  # every train rank takes part
        return metrics, grid, lost

    def log_row(self, step: int, metrics: dict, grid=None) -> None:
        """Rank 0: a step's metrics to run.h5 and the trackers, its grid to samples/."""
        if self.writer:
            self.writer.append_metrics(step, metrics)
            self.trackers.log_row(step, metrics)
            if grid is not None:
                self.trackers.log_image(step, "samples", save_grid(self.cfg.run_dir, step, *grid))

    def say_lines(self, lines: list[str]) -> None:
        for line in lines:
            print(line, flush=True)
            log.info(line)

    def learning_lines(self, step: int, metrics: dict) -> list[str]:
        """Rank 0: the evaluation's line when one ran, and at the end of a pass over the prompts
        its mean training reward (run.h5's rows of the pass, earlier starts' too) with the latest
        evaluation: whether the run learns, on the terminal."""
        lines = []
        if any(k.startswith("eval/") for k in metrics):
            self.latest_eval = (step, {k: v for k, v in metrics.items() if k.startswith("eval/")})
            lines.append(eval_line(step, metrics))
        per_step, n = self.cfg.rollout.prompts_per_step, len(self.tr.stream.prompts)
        p = pass_of(step, per_step, n)
        if step == 0 or step != pass_last_step(p, per_step, n):
            return lines
        first = pass_last_step(p - 1, per_step, n) + 1 if p else 1
        rows = self.writer.rows_between(first - 1, step)
        rewards = [r["rollout/reward/raw_mean"] for r in rows.values() if "rollout/reward/raw_mean" in r]
        if self.latest_eval is None:  # an earlier start's evaluation
            evals = {s: {k: v for k, v in r.items() if k.startswith("eval/")} for s, r in
                     self.writer.rows_between(-1, step).items()}
            found = [(s, e) for s, e in evals.items() if e]
            self.latest_eval = found[-1] if found else None
        if rewards:
            lines.append(pass_line(p, first, step, sum(rewards) / len(rewards), self.latest_eval))
        return lines

    def run(self) -> int:
        cfg, tr = self.cfg, self.tr
        start_step = self.start()
        t_begin = time.perf_counter()
        if start_step >= cfg.steps:  # run.h5 was rebuilt first (entry says it before loading otherwise)
            self.say(finished_line(cfg.run_dir, start_step))
        for step in range(start_step + 1, cfg.steps + 1):
            self.step = step
            rng = determinism.capture_rng_state()  # what a checkpoint of step - 1 holds, if this one is lost
            try:
                metrics, grid, lost = self.iterate(step)
            except RewardOutage as e:
                return self.outage(step - 1, e, rng)
            self.report_term_warnings(step)
            self.log_row(step, metrics, grid)
            if self.writer:
                line = progress_line(step, cfg.steps, metrics, time.perf_counter() - t_begin, start_step + 1,
                                     self.tr.algorithm.spec.loss_key)
                self.say_lines([line, *self.learning_lines(step, metrics)])
            if lost is not None:
                return self.outage(step, lost, note=" (its evaluation is made when the run resumes)")
            stop = self.stop_requested()
            verdict = self.watch.observe(step, metrics)
            halt = self.watch.halts(verdict)
            if self.checkpointer.due(step, cfg.steps) or stop or verdict.new_best or halt:
                t_save = time.perf_counter()
                saved = self.checkpointer.save(step)
                if saved:  # rank 0: what a checkpoint of this run costs, for the log
                    log.info("checkpoint of step %d: %.1f MiB in %.2f s", step, folder_bytes(saved) / 2**20,
                             time.perf_counter() - t_save)
                self.saved_step = step
            self.watch.record(self.writer, self.checkpointer, step, verdict, self.saved_step == step)
            if halt and step < cfg.steps:
                return self.guard_stop(step)
            if stop and step < cfg.steps:
                return self.preempted(step)
        tr.client.finish(cfg.steps)
        if self.writer:
            self.writer.event(cfg.steps, "done", f"finished {steps_text(cfg.steps)}")
        if start_step < cfg.steps:
            wall = time.strftime("%H:%M:%S", time.gmtime(time.perf_counter() - t_begin))
            self.say(f"finished {steps_text(cfg.steps)} ({cfg.steps - start_step} in this start, {wall}); run file "
                     f"{os.path.join(cfg.run_dir, 'run.h5')}; last checkpoint {self.checkpointer.last or 'none'}")
        return EXIT_OK

    def outage(self, done: int, e: RewardOutage, rng: bytes | None = None, note: str = "") -> int:
        """Every train rank: a reward term's service stayed unreachable past its wait while step
        done + 1 was scored (or the evaluation of step `done`). The steps finished are kept:
        step `done` is checkpointed (with `rng`, the RNG state it ended with), the reward rank
        told to stop, and the job exits 69, not requeued."""
        if done and done != self.saved_step:
            self.checkpointer.save(done, rng)
            self.saved_step = done
        self.tr.client.finish(done, preempted=True)
        kept = f"checkpointed step {done}{note}" if done else "no step was finished: nothing to save"
        if self.writer:
            self.writer.event(done, "error", f"{e}; stopped: {kept}")
        if self.topo.rank == 0:
            then = f"; `{self.resume_command}` resumes it" if done and self.resume_command else ""
            print_err(f"{e}; {kept}{then}")
        return EXIT_UNAVAILABLE

    def preempted(self, step: int) -> int:
        self.tr.client.finish(step, preempted=True)
        if self.writer:
            why = self.flag.signal_name or "the reward rank's signal"
            self.writer.event(step, "signal", f"{why}: checkpointed step {step}, stopping")
            job = self.topo.job_id
            if job and self.cfg.preempt.requeue and not os.environ.get("SUBMITIT_EXECUTOR"):
                skip = leave_requeue_to_slurm(self.flag.signal_name, self.cfg.preempt.signal)
                self.writer.event(step, "requeue", skip or f"requeue of Slurm job {job} requested")
                self.requeue_job = "" if skip else job
        if self.topo.rank == 0:
            how = "interrupted" if self.flag.interrupted else "preempted"
            then = f"; Slurm job {self.requeue_job} is requeued to resume it" if self.requeue_job else \
                (f"; `{self.resume_command}` resumes it" if self.resume_command else "")
            print(f"hpcnft: {how} at step {step}: checkpointed{then}", flush=True)
        return EXIT_INTERRUPTED if self.flag.interrupted else EXIT_PREEMPTED


def train_main(cfg: Config, topo, group, mesh, flag: PreemptFlag, plan: ResumePlan, resume: str = "") -> int:
    job = TrainJob(cfg, topo, group, mesh, flag, plan, resume)
    try:
        return job.run()
    except BaseException as e:
        if isinstance(e, Exception):  # before the error is relayed: the first failure is this rank's
            claim_first_failure(cfg.run_dir, topo.rank, e)
        if job.writer:
            try:
                job.writer.event(job.step, "error", fail_line(topo, e))
            except Exception:  # noqa: BLE001 - the original error matters more
                pass
        if not isinstance(e, RewardServiceError):
            job.tr.client.report_error(fail_line(topo, e))
        raise
    finally:
        job.trackers.close()
        close_then_requeue(job.writer, job.requeue_job)


def close_then_requeue(writer, job_id: str) -> None:
    """Close run.h5, then requeue the Slurm job: Slurm kills the job's processes right after a
    requeue, and a writer killed with the file open leaves it flagged for recovery."""
    if writer:
        writer.close()
    if job_id:
        outcome = requeue(job_id, log)
        if outcome.startswith("requeued"):
            print(f"hpcnft: {outcome}", flush=True)
        else:
            print_err(outcome)


