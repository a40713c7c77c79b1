"""How `hpcnft run` starts, whatever started it.

With no launcher in the environment this process is the local spawner: it checks the input
once (config, layout against the world size, prompt files, model folders, run dir and its
lock) and starts the layout's ranks as new interpreters
running `python -m hpcnft.run.rank` (distributed.spawner), holding the run dir's lock until
rank 0 takes it over. The spawner imports no torch: the ranks load it and the models, and
build the tiny models (once, under a file lock). Where no rank can use a GPU, a fork server
(distributed.fork_server) imports the ranks' libraries once and forks them instead, and the
spawner adopts them (a tiny 3-rank job starts several seconds sooner on 2 cores). Under
torchrun, srun, mpirun or submitit this process is one rank of the job (run.entry.rank_main)."""
from __future__ import annotations

import os
import sys

from hpcnft.algo.root_config import load_config
from hpcnft.common import collector
from hpcnft.common.errors import (EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_OK, EXIT_PREEMPTED, EXIT_UNAVAILABLE,
                                  ConfigError, UsageError)
from hpcnft.distributed.config import local_world_size
from hpcnft.distributed.detect import detect
from hpcnft.distributed.launch import LaunchError, roles
from hpcnft.run.failures import FailureClaim
from hpcnft.run.rundir import (check_existing_run, check_input, default_run_dir, lock_run_dir,
                               resume_command, resume_line)

# exits after which rank 0 or the spawner has said how to go on, or that need no resume
CHECKPOINTED_OR_REFUSED = (EXIT_OK, EXIT_BAD_INPUT, EXIT_PREEMPTED, EXIT_INTERRUPTED, EXIT_UNAVAILABLE)


def start(recipe: str, overrides: list[str], run_dir: str | None, steps: int | None) -> int:
    """`hpcnft run RECIPE [--set ...] [--run-dir D] [--steps N]`: the job's exit code (this
    rank's under a launcher). Bad input raises UsageError (one line)."""
    from hpcnft.run.estimate import print_startup_notes

    try:
        cfg = load_config(recipe, overrides, steps=steps, run_dir=run_dir)
        info = detect(os.environ)
        print_startup_notes(cfg, recipe, info)  # a recipe file's base; a step that will be long
    except (ConfigError, LaunchError) as e:
        raise UsageError(str(e)) from None
    if info.launcher == "none" and not os.environ.get("HPCNFT_LAUNCHER"):
        from hpcnft.run.output_guard import guard_std_streams

        guard_std_streams()  # a closed output stops the spawner's printing, never the spawner; its ranks stop
        collector.settle()
        return spawn_job(cfg, recipe, overrides)
    from hpcnft.run.entry import rank_main

    return rank_main(cfg, info, recipe, overrides)


def spawn_job(cfg, recipe: str, overrides: list[str]) -> int:
    """No launcher: check the input, take the run dir, then start the ranks. This process holds
    the run dir's lock while the ranks run and hands it to rank 0, so a second start is refused
    before it spawns anything."""
    from hpcnft.io.rundir_lock import INHERITED_FD_ENV, RunDirInUse

    os.umask(int(cfg.umask, 8))  # run dirs and files: private to the user by default (077)
    cfg.run_dir = cfg.run_dir or default_run_dir(recipe)
    check_input(cfg, local_world_size(cfg))
    created = not os.path.exists(cfg.run_dir)
    try:
        os.makedirs(cfg.run_dir, mode=0o700, exist_ok=True)
    except OSError as e:
        raise UsageError(f"run dir {cfg.run_dir!r}: {e.strerror}") from None
    try:
        lock = lock_run_dir(cfg.run_dir, warn=lambda text: print(f"hpcnft: {text}", file=sys.stderr, flush=True))
    except RunDirInUse as e:
        print(f"hpcnft: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    try:
        finished = check_existing_run(cfg)  # only now: the run dir's owner may be writing its run.h5
        if finished:  # said before any rank starts
            print(f"hpcnft: {finished}", flush=True)
            return EXIT_OK
        code = spawn_ranks(cfg, recipe, overrides, rank0_fd=(INHERITED_FD_ENV, lock.fd))
    finally:
        lock.release()
    if code == EXIT_BAD_INPUT and created:
        remove_if_unused(cfg.run_dir)  # the ranks refused before writing anything: no run dir is left
    return code


def remove_if_unused(run_dir: str) -> None:
    """Remove a run dir this start made that holds nothing but its lock file."""
    from hpcnft.io.rundir_lock import LOCK_NAME

    try:
        if set(os.listdir(run_dir)) <= {LOCK_NAME}:
            for name in os.listdir(run_dir):
                os.remove(os.path.join(run_dir, name))
            os.rmdir(run_dir)
    except OSError:
        pass


def spawn_ranks(cfg, recipe: str, overrides: list[str], rank0_fd) -> int:
    from hpcnft.distributed.spawner import ranks_can_fork, spawn_local
    from hpcnft.run.rank import handover

    world = local_world_size(cfg)
    train, reward = roles(world, cfg.layout.reward_ranks)
    print(f"hpcnft: run dir {cfg.run_dir} | {world} rank(s): train {train}, reward {reward or 'colocated'}",
          flush=True)
    fork = ("hpcnft.run.rank:preload", "hpcnft.run.rank:main") if ranks_can_fork(cfg.layout.device) else None
    claim = FailureClaim(cfg.run_dir)
    claim.clear()
    resume = resume_command(recipe, overrides, cfg.run_dir, cfg.steps)
    # the config as resolved here, whole: no rank parses the recipe or the --set strings again
    code = spawn_local([], world, lambda r: "reward" if r in reward else "train", rank0_fd=rank0_fd, fork=fork,
                       preempted_code=EXIT_PREEMPTED, resume_hint=lambda: resume_line(cfg.run_dir, resume),
                       failure_claim=claim, env=handover(cfg, recipe, overrides))
    if code not in CHECKPOINTED_OR_REFUSED:  # a rank failed: the steps up to the last checkpoint are kept
        print(f"hpcnft: {resume_line(cfg.run_dir, resume)}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    return code
