"""A rank's process from start to exit code: determinism, the preempt flag, the models, the
process group, then the train job or the reward service. Bad input exits 2, a failure 1 (one
line naming the rank, the traceback in its log), preemption 75."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

from hpcnft.algo.prompts import PromptFileError
from hpcnft.common import determinism, term_warnings
from hpcnft.algo.root_config import Config, ConfigError
from hpcnft.distributed.config import check_layout
from hpcnft.common.errors import (EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_PREEMPTED, UsageError,
                                  one_line)
from hpcnft.distributed import groups, spawner
from hpcnft.distributed.launch import LaunchInfo
from hpcnft.distributed.preempt import OUTPUT_CLOSED, PreemptFlag
from hpcnft.models.loading import ModelError, check_model_folders, resolve_model_paths
from hpcnft.rewards.registry import build_tiny_models
from hpcnft.run.job import train_main
from hpcnft.run.failures import FailureClaim
from hpcnft.run.output import (fail_line, guard_output, log, log_exception, print_err, report_failure, restore_stderr,
                               setup_logging)
from hpcnft.run.resume import RunFileLostError, agree_plan
from hpcnft.run.reward_rank import reward_main
from hpcnft.run.rundir import (check_term_extras, check_trackers, default_run_dir, finished_line, lock_run_dir,
                               resume_command, resume_line, tiny_models_needed)

BAD_INPUT = (ModelError, PromptFileError, ConfigError)


def agree_run_dir(cfg: Config, recipe: str, topo) -> str:
    """Every rank must write into the same run dir: rank 0's choice wins."""
    choice = [cfg.run_dir or default_run_dir(recipe)]
    dist.broadcast_object_list(choice, src=0)
    cfg.run_dir = choice[0]
    return cfg.run_dir


def take_run_dir(cfg: Config, rank: int, notes: list[str]):
    """Rank 0 becomes the run dir's owner before anything is written into it; every rank learns
    the outcome, so a refused start ends on all ranks together rather than leaving the others
    waiting in a collective. Returns (the lock on rank 0, else None; None or (exit code, the
    line rank 0 reports)). `notes` receives rank 0's warnings, for its log."""
    lock, refusal = None, None
    if rank == 0:
        def warn(text: str) -> None:
            print_err(text)
            notes.append(text)
        try:
            lock = lock_run_dir(cfg.run_dir, warn=warn, inherited=True)
        except UsageError as e:
            refusal = (EXIT_BAD_INPUT, str(e))
        except Exception as e:  # noqa: BLE001 - the other ranks must hear of it, not hang
            refusal = (EXIT_FAILED, f"rank 0: cannot take run dir {cfg.run_dir}: {one_line(e)}")
    outcome = [refusal]
    dist.broadcast_object_list(outcome, src=0)
    return lock, outcome[0]


def rank_main(cfg: Config, info: LaunchInfo, recipe: str, overrides=()) -> int:
    """The rank's exit code. `recipe` and `overrides` are the command's: what a resume repeats."""
    spawner.name_process(info.rank)
    device_type = "cuda" if (cfg.layout.device != "cpu" and torch.cuda.is_available()) else "cpu"
    determinism.enable(cfg.determinism.enabled, cfg.determinism.cpu_threads, device_type)
    if os.environ.get("HPCNFT_LAUNCHER"):  # ranks started by our spawner or through submitit
        info = dataclasses.replace(info, launcher=os.environ["HPCNFT_LAUNCHER"])
    flag = PreemptFlag(cfg.preempt.signal, cfg.preempt.handle_sigterm, log)  # before anything slow
    guard_output(lambda: flag.request(OUTPUT_CLOSED))  # printing to a closed pipe stops the run, checkpointed
    if os.environ.get(spawner.SPAWNER_PID_ENV):  # never an orphan: the spawner's death stops the rank
        spawner.end_with_parent(int(os.environ[spawner.SPAWNER_PID_ENV]))
    try:
        code = _rank_main(cfg, info, recipe, list(overrides), flag)
    finally:
        flag.retire()  # the rank's outcome is decided: a late preempt signal must not change it
        restore_stderr()
    if code == EXIT_FAILED and dist.is_initialized():
        # A failed rank leaves at once: a process group with operations still posted (a
        # collective a dead peer never joined) can hang the interpreter's exit.
        logging.shutdown()
        sys.stdout.flush()
        os._exit(code)
    groups.teardown()  # a refused start (bad input) leaves no process group behind either
    return code


def stopped_before_start(flag: PreemptFlag, rank: int) -> int | None:
    """A stop signal that came before the job began (while the rank imported or built the tiny
    models): there is nothing to checkpoint, so the rank leaves as a preempted (or interrupted)
    one: its exit code, else None."""
    if not flag.requested:
        return None
    if rank == 0:
        what = "interrupted" if flag.interrupted else flag.signal_name
        print_err(f"{what} before the job started: nothing to save")
    return EXIT_INTERRUPTED if flag.interrupted else EXIT_PREEMPTED


def refused(info: LaunchInfo, line: str) -> int:
    """Bad input every rank meets alike, before the rendezvous: said once per node (by its first
    rank), and left for torchrun's failure summary (TORCHELASTIC_ERROR_FILE) by every rank, so
    that the rank torchrun names as the root cause gives hpcnft's reason, not a link to its docs."""
    if info.local_rank == 0:
        print_err(line)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            with open(path, "w") as f:
                json.dump({"message": f"hpcnft: {line}", "timestamp": int(time.time())}, f)
        except OSError:
            pass  # the line is on the terminal already
    return EXIT_BAD_INPUT


def _rank_main(cfg: Config, info: LaunchInfo, recipe: str, overrides: list[str], flag: PreemptFlag) -> int:
    os.umask(int(cfg.umask, 8))  # run dirs, logs and checkpoints: private to the user by default (077)
    stopped = stopped_before_start(flag, info.rank)
    if stopped is not None:
        return stopped
    try:  # what every rank would refuse alike: refused before the rendezvous, said once per node
        check_trackers(cfg)
        check_term_extras(cfg)
        check_layout(cfg, info.world_size)
        backend = groups.resolve_backend(cfg, groups.pick_device(cfg, info.local_rank))  # the device and backend here
        groups.resolve_transport(cfg, backend)
    except (UsageError, ConfigError) as e:
        return refused(info, str(e))
    try:
        # The tiny models are built (once, under a file lock) before the process group exists:
        # with a group up, transformers' save_pretrained writes nothing on ranks other than 0.
        if info.rank == 0 and tiny_models_needed(cfg):
            print("hpcnft: building the tiny models (once, into the cache)", flush=True)
        check_model_folders(cfg, resolve_model_paths(cfg))  # headers against configs: no weight loads
        build_tiny_models(cfg)  # the reward terms' tiny models
    except BAD_INPUT as e:  # every rank of a node meets it alike: its first rank says it
        return refused(info, f"rank {info.rank}: {type(e).__name__}: {e}")
    stopped = stopped_before_start(flag, info.rank)
    if stopped is not None:
        return stopped
    try:
        topo, group, mesh = groups.setup(cfg, info)
    except ConfigError as e:
        return refused(info, str(e))
    except groups.RendezvousError as e:
        print_err(str(e))
        return EXIT_FAILED
    agree_run_dir(cfg, recipe, topo)
    notes: list[str] = []
    lock, refusal = take_run_dir(cfg, topo.rank, notes)
    if refusal:
        code, line = refusal
        if topo.rank == 0:
            print_err(line)
        groups.teardown()
        return code
    if topo.rank == 0:
        FailureClaim(cfg.run_dir).clear()  # before agree_plan's collective: no rank has failed yet
    try:
        resume = resume_command(recipe, overrides, cfg.run_dir, cfg.steps)
        return _run_role(cfg, topo, group, mesh, flag, notes, info.endpoint, resume)
    finally:
        if lock:
            lock.release()  # a clean exit clears the holder line; a killed owner leaves it


def _run_role(cfg: Config, topo, group, mesh, flag: PreemptFlag, notes: list[str], endpoint: str,
              resume: str) -> int:
    setup_logging(cfg.run_dir, topo.rank)
    log.info("rank %d of %d (%s) on %s, launcher %s, pid %d", topo.rank, topo.world_size, topo.role, topo.device,
             topo.launcher, os.getpid())
    log.info("collectives bind %s (GLOO_SOCKET_IFNAME; NCCL_SOCKET_IFNAME %s); master %s",
             os.environ.get("GLOO_SOCKET_IFNAME") or "the backend's default interface",
             os.environ.get("NCCL_SOCKET_IFNAME") or "unset", endpoint)
    for text in notes:
        log.warning(text)
    term_warnings.announce_to(lambda text: (log.warning(text), print_err(text)))  # a remote term's wait, said now
    try:
        plan = agree_plan(cfg, topo.rank)  # where every rank resumes, and whether run.h5 is rebuilt first
    except Exception as e:  # noqa: BLE001 - rank 0's failure, raised on every rank: said once
        log_exception(topo, e)
        refused = isinstance(e, (ConfigError, RunFileLostError))
        if topo.rank == 0:
            print_err(fail_line(topo, e) + ("" if refused else f" (traceback in {cfg.run_dir}/logs/rank0.log)"))
        return EXIT_BAD_INPUT if refused else EXIT_FAILED
    done = plan.checkpoint[0] if plan.checkpoint and not plan.rebuild_why else -1
    if done >= cfg.steps:  # said before any model loads
        if topo.rank == 0:
            print(f"hpcnft: {finished_line(cfg.run_dir, done)}", flush=True)
        groups.teardown()
        return EXIT_OK
    try:
        code = reward_main(cfg, topo, flag, plan) if topo.role == "reward" else \
            train_main(cfg, topo, group, mesh, flag, plan, resume)
    except BAD_INPUT as e:  # every rank meets it alike: said once
        report_failure(topo, cfg.run_dir, e)
        return EXIT_BAD_INPUT
    except Exception as e:  # noqa: BLE001 - one line out, the traceback in the rank's log
        report_failure(topo, cfg.run_dir, e, f" (traceback in {cfg.run_dir}/logs/rank{topo.rank}.log)")
        if topo.rank == 0 and os.environ.get("HPCNFT_LAUNCHER") != "local":  # the local spawner says it last
            print_err(resume_line(cfg.run_dir, resume))
        return EXIT_FAILED
    groups.teardown()
    return code
