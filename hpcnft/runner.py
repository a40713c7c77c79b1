"""The run on one rank, from start (or resume) to finish: a train rank's loop, or the reward
rank's service. Failures become one line naming the rank and its reason."""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

from hpcnft import __version__, checkpoint, determinism, distributed, fast
from hpcnft.config import Config, ConfigError, differing_keys, flatten
from hpcnft.launch import LaunchInfo
from hpcnft.loop import (EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, EXIT_PREEMPTED, TrainRank, fail_line, log,
                         log_exception, print_err, progress_line, restore_stderr, save_grid, seed_everything,
                         setup_logging)
from hpcnft.models import ModelError, load_pickscore, load_sd3_pipeline, resolve_model_paths
from hpcnft.preempt import PreemptFlag, leave_requeue_to_slurm, requeue
from hpcnft.prompts import PromptFileError, PromptStream, read_prompt_file
from hpcnft.reward import PickScoreScorer
from hpcnft.reward_service import EVAL, LocalRewardClient, RemoteRewardClient, RewardServiceError, serve

BAD_INPUT = (ModelError, PromptFileError, ConfigError)


def agree_run_dir(cfg: Config, recipe: str, topo) -> str:
    """Every rank must write into the same run dir: rank 0's choice wins."""
    from hpcnft.cli_run import default_run_dir

    choice = [cfg.run_dir or default_run_dir(recipe)]
    dist.broadcast_object_list(choice, src=0)
    cfg.run_dir = choice[0]
    return cfg.run_dir


def make_score_fn(cfg: Config, scorer: PickScoreScorer):
    """(kind, step, images, sample ids) -> scores; the prompts come from this rank's own copy
    of the prompt files, by the same rule the train ranks use."""
    stream = PromptStream(read_prompt_file(cfg.data.train_prompts, "data.train_prompts"), cfg.data.shuffle,
                          cfg.train.seed)
    eval_prompts = read_prompt_file(cfg.data.eval_prompts, "data.eval_prompts")
    p, g = cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt

    def score(kind: int, step: int, images: torch.Tensor, ids: list[int]) -> torch.Tensor:
        if kind == EVAL:
            return scorer([eval_prompts[i] for i in ids], images)
        return cfg.reward.scale * scorer([stream.at((step - 1) * p + i // g) for i in ids], images)

    return score


def load_scorer(cfg: Config, device: torch.device) -> PickScoreScorer:
    paths = resolve_model_paths(cfg)
    scorer = PickScoreScorer(*load_pickscore(paths.pickscore, paths.pickscore_processor, device), device)
    return fast.prepare_scorer(scorer, cfg)  # perf.pickscore_dtype


def reward_main(cfg: Config, topo, flag: PreemptFlag) -> int:
    score_fn = make_score_fn(cfg, load_scorer(cfg, topo.device))
    found = checkpoint.latest_usable(cfg.run_dir, log.warning)
    blob = checkpoint.read_rng(found[1], topo.rank) if found else None
    if blob is not None:
        determinism.restore_rng_state(blob)

    def snapshot(step: int) -> None:
        with open(checkpoint.rng_path(checkpoint.partial_dir(cfg.run_dir, step), topo.rank), "wb") as f:
            f.write(determinism.capture_rng_state())

    log.info("reward rank %d serving train ranks %s", topo.rank, topo.clients_of(topo.rank))
    stats = serve(topo.clients_of(topo.rank), topo.host_group, score_fn, snapshot, flag)
    log.info("reward rank done: busy %.1f s, idle %.1f s", stats["busy_s"], stats["idle_s"])
    return EXIT_PREEMPTED if stats["preempted"] else EXIT_OK


def build_train_rank(cfg: Config, topo, group, mesh) -> TrainRank:
    from hpcnft.trainer import Policy, Trainer

    seed_everything(cfg)
    paths = resolve_model_paths(cfg)
    pipe = load_sd3_pipeline(paths.sd3, torch.float32, topo.device)
    fast.prepare_vae(pipe.vae, cfg)  # perf.vae_dtype, vae_channels_last, compile_vae, cudnn_benchmark
    if topo.device.type == "cuda" and cfg.train.precision != "fp32":
        dtype = torch.float16 if cfg.train.precision == "fp16" else torch.bfloat16
        for enc in (pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3):
            enc.to(dtype)
    if topo.role == "colocated":
        client = LocalRewardClient(make_score_fn(cfg, load_scorer(cfg, topo.device)),
                                   overlap=cfg.perf.overlap_reward)  # perf.overlap_reward
    else:
        client = RemoteRewardClient(topo.reward_rank_for(topo.rank), topo.host_group, cfg.layout.timeout_s)
    policy = Policy(cfg, pipe.transformer, topo.device, mesh)
    trainer = Trainer(cfg, policy, group, len(topo.train_ranks))
    return TrainRank(cfg, topo, group, mesh, client, pipe, policy, trainer)


def agree(group, value, src: int = 0):
    """Rank `src`'s value on every train rank."""
    box = [value]
    if group is not None:
        dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def check_resumable(cfg: Config, run_dir: str, warn) -> tuple[int, str] | None:
    """The checkpoint to resume from, refusing one whose config differs (ConfigError)."""
    found = checkpoint.latest_usable(run_dir, warn)
    if found is None:
        return None
    stored = checkpoint.read_json(found[1], "config.json")
    diff = differing_keys(stored, cfg.to_dict())
    if diff:
        flat_old, flat_new = flatten(stored), flatten(cfg.to_dict())
        detail = ", ".join(f"{k} ({flat_old.get(k)!r} -> {flat_new.get(k)!r})" for k in diff)
        raise ConfigError(f"cannot resume {run_dir}: the config differs from its checkpoint in {detail}")
    return found


class TrainJob:
    """A train rank's run: resume, iterate, evaluate, checkpoint, stop on preemption."""

    def __init__(self, cfg: Config, topo, group, mesh, flag: PreemptFlag):
        self.cfg, self.topo, self.group, self.flag = cfg, topo, group, flag
        self.tr = build_train_rank(cfg, topo, group, mesh)
        self.writer = None
        self.warnings: list[str] = []
        self.requeue_job = ""  # rank 0, preempted under Slurm: requeue this job once run.h5 is closed

    def _warn(self, text: str) -> None:
        log.warning(text)
        self.warnings.append(text)

    def resume(self) -> int:
        cfg, tr = self.cfg, self.tr
        found = agree(self.group, check_resumable(cfg, cfg.run_dir, self._warn) if self.topo.rank == 0 else None)
        if found is None:
            return 0
        step, path = found
        state = checkpoint.load(path, tr.policy, tr.trainer.optimizer, self.group)
        tr.trainer.scaler.load_state_dict(state.scaler)
        blob = checkpoint.read_rng(path, self.topo.rank)
        if blob is not None:
            determinism.restore_rng_state(blob)
        self.resumed_from = path
        return step

    def open_run_file(self, start_step: int) -> None:
        from hpcnft.runfile import EVAL_KEYS, RunFileWriter

        cfg, topo = self.cfg, self.topo
        w = self.writer = RunFileWriter(os.path.join(cfg.run_dir, "run.h5"), cfg.to_json(), __version__)
        w.set_topology(topo.as_attrs())
        for text in self.warnings:
            w.event(start_step, "error", text)
        if start_step:
            # An eval that ran only because the earlier run ended at start_step is not one an
            # uninterrupted run would have: it goes, so both runs hold the same rows.
            periodic = cfg.eval.every and start_step % cfg.eval.every == 0
            end_only = () if periodic or start_step >= cfg.steps else tuple(EVAL_KEYS)
            dropped = w.truncate_after(start_step, inclusive_keys=end_only)
            w.drop_rng_after(start_step)
            w.event(start_step, "resume", f"resumed from {self.resumed_from}; dropped {dropped} metric rows "
                                          f"after step {start_step}")
        else:
            w.truncate_after(-1)  # a run that died before its first checkpoint starts over
        w.add_attempt({"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "from_step": start_step,
                       "slurm_job_id": topo.job_id or "", "restart_count": topo.restart_count,
                       "launcher": topo.launcher, "world_size": topo.world_size,
                       "resumed_from": getattr(self, "resumed_from", "")})
        w.event(start_step, "start", f"{topo.launcher} launch, world {topo.world_size}, train ranks "
                                     f"{topo.train_ranks}, reward ranks {topo.reward_ranks or 'colocated'}")

    def warn_truncated_prompts(self, step: int) -> None:
        """Rank 0, once per start: how many prompts the text encoders will cut."""
        from hpcnft.sampler import truncated_prompts

        cfg, tr = self.cfg, self.tr
        n_eval = min(cfg.eval.num_prompts or len(tr.eval_prompts), len(tr.eval_prompts))
        prompts = tr.stream.prompts + tr.eval_prompts[:n_eval]
        n_cut, by_encoder = truncated_prompts(tr.pipe, prompts, cfg.rollout.max_sequence_length)
        if not n_cut:
            return
        limits = {"CLIP": f"{tr.pipe.tokenizer_max_length} tokens",
                  "T5": f"rollout.max_sequence_length = {cfg.rollout.max_sequence_length} tokens"}
        detail = ", ".join(f"{name} cuts {n} (over {limits[name]})" for name, n in by_encoder.items() if n)
        text = (f"{n_cut} of {len(prompts)} prompts (train and eval) are longer than the text encoders take "
                f"and are truncated: {detail}")
        log.warning(text)
        print_err(f"warning: {text}")
        if self.writer:
            self.writer.event(step, "warning", text)

    def save_checkpoint(self, step: int) -> None:
        cfg, tr, topo = self.cfg, self.tr, self.topo
        try:
            tmp = checkpoint.save(cfg.run_dir, step, tr.policy, tr.trainer.optimizer, self.group, topo.rank == 0,
                                  topo.rank, determinism.capture_rng_state())
            tr.client.snapshot(step)  # the reward rank's RNG state, into the same checkpoint
            if self.group is not None:
                dist.barrier(group=self.group)
            if self.writer:
                states = {r: checkpoint.read_rng(tmp, r) for r in range(topo.world_size)}
                self.writer.write_rng(step, {r: b for r, b in states.items() if b is not None})
                state = checkpoint.TrainState(step, step * cfg.rollout.prompts_per_step,
                                              tr.trainer.scaler.state_dict())
                final = checkpoint.commit(cfg.run_dir, step, state, cfg.to_json(), cfg.checkpoint.keep)
                self.writer.event(step, "checkpoint", final)
        except BaseException:
            if topo.rank == 0:  # a failed checkpoint leaves no .partial behind; older ones stay
                checkpoint.discard_partial(cfg.run_dir, step)
            raise
        if self.group is not None:
            dist.barrier(group=self.group)

    def stop_requested(self) -> bool:
        """Every train rank's flag and the reward rank's, agreed at the end of an iteration."""
        local = torch.tensor([float(self.flag.requested or self.tr.client.peer_preempt)], device=self.topo.comm_device)
        if self.group is not None:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.group)
        return bool(local.item())

    def run(self) -> int:
        cfg, tr, topo = self.cfg, self.tr, self.topo
        start_step = self.resume()
        if topo.rank == 0:
            self.open_run_file(start_step)
            self.warn_truncated_prompts(start_step)
        w = self.writer
        if cfg.eval.at_start and start_step == 0:
            m = tr.evaluate()
            if w:
                w.append_metrics(0, m)
        t_begin = time.perf_counter()
        for step in range(start_step + 1, cfg.steps + 1):
            metrics, ro = tr.iteration(step)
            if (cfg.eval.every and step % cfg.eval.every == 0) or (step == cfg.steps and cfg.eval.at_end):
                metrics.update(tr.evaluate())
            every, n_grid = cfg.logging.sample_grid_every, cfg.logging.sample_grid_images
            grid = tr.grid_images(step, ro.images, n_grid) if every and n_grid and \
                (step % every == 0 or step == 1) else None  # every train rank takes part
            if w:
                w.append_metrics(step, metrics)
                if grid is not None:
                    save_grid(cfg.run_dir, step, *grid)
                line = progress_line(step, cfg.steps, metrics, time.perf_counter() - t_begin, start_step + 1)
                print(line, flush=True)
                log.info(line)
            stop = self.stop_requested()
            due = (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or \
                (step == cfg.steps and cfg.checkpoint.at_end)
            if due or stop:
                self.save_checkpoint(step)
            if stop and step < cfg.steps:
                return self.preempted(step)
        tr.client.finish(cfg.steps)
        if w:
            w.event(cfg.steps, "done", f"finished {cfg.steps} steps")
        return EXIT_OK

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
            print(f"hpcnft: preempted at step {step}; the same command resumes from its checkpoint", flush=True)
        return EXIT_PREEMPTED


def train_main(cfg: Config, topo, group, mesh, flag: PreemptFlag) -> int:
    job = TrainJob(cfg, topo, group, mesh, flag)
    try:
        return job.run()
    except BaseException as e:
        if job.writer:
            try:
                job.writer.event(0, "error", fail_line(topo, e))
            except Exception:  # noqa: BLE001 - the original error matters more
                pass
        if not isinstance(e, RewardServiceError):
            job.tr.client.report_error(fail_line(topo, e))
        raise
    finally:
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


def run_rank(cfg: Config, info: LaunchInfo, recipe: str) -> int:
    device_type = "cuda" if (cfg.layout.device != "cpu" and torch.cuda.is_available()) else "cpu"
    determinism.enable(cfg.determinism.enabled, cfg.determinism.cpu_threads, device_type)
    if os.environ.get("HPCNFT_LAUNCHER"):  # ranks started by our spawner or through submitit
        info = dataclasses.replace(info, launcher=os.environ["HPCNFT_LAUNCHER"])
    flag = PreemptFlag(cfg.preempt.signal, cfg.preempt.handle_sigterm, log)  # before anything slow
    try:
        code = _run_rank(cfg, info, recipe, flag)
    finally:
        flag.retire()  # the rank's outcome is decided: a late preempt signal must not change it
        restore_stderr()
    if code == EXIT_FAILED and dist.is_initialized():
        # A failed rank leaves at once: a process group with operations still posted (NCCL's
        # header receives, a collective a dead peer never joined) can hang the interpreter's exit.
        logging.shutdown()
        sys.stdout.flush()
        os._exit(code)
    return code


def _run_rank(cfg: Config, info: LaunchInfo, recipe: str, flag: PreemptFlag) -> int:
    os.umask(int(cfg.umask, 8))  # run dirs, logs and checkpoints: private to the user by default (077)
    try:
        # The tiny models are built (once, under a file lock) before the process group exists:
        # with a group up, transformers' save_pretrained writes nothing on ranks other than 0.
        resolve_model_paths(cfg)
    except BAD_INPUT as e:
        print_err(f"rank {info.rank}: {type(e).__name__}: {e}")
        return EXIT_BAD_INPUT
    try:
        topo, group, mesh = distributed.setup(cfg, info)
    except ConfigError as e:
        print_err(f"rank {info.rank}: {e}")
        return EXIT_BAD_INPUT
    except distributed.RendezvousError as e:
        print_err(str(e))
        return EXIT_FAILED
    agree_run_dir(cfg, recipe, topo)
    setup_logging(cfg.run_dir, topo.rank)
    log.info("rank %d of %d (%s) on %s, launcher %s", topo.rank, topo.world_size, topo.role, topo.device,
             topo.launcher)
    try:
        if cfg.samples_per_step % len(topo.train_ranks):
            raise ConfigError(f"rollout: {cfg.samples_per_step} samples per step do not split evenly over "
                              f"{len(topo.train_ranks)} train ranks")
        code = reward_main(cfg, topo, flag) if topo.role == "reward" else train_main(cfg, topo, group, mesh, flag)
    except BAD_INPUT as e:
        log_exception(topo, e)
        print_err(fail_line(topo, e))
        return EXIT_BAD_INPUT
    except Exception as e:  # noqa: BLE001 - one line out, the traceback in the rank's log
        log_exception(topo, e)
        print_err(fail_line(topo, e) + f" (traceback in {cfg.run_dir}/logs/rank{topo.rank}.log)")
        return EXIT_FAILED
    distributed.teardown()
    return code
