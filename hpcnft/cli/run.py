"""`hpcnft run` and `hpcnft make-tiny`.

`run` checks its input once, up front (config, prompt files, model folders, run dir and its
lock), so bad input or a run dir in use is one line and exit 2 before any rank starts. With no
launcher in the environment it spawns the layout's ranks as local processes; under torchrun,
srun, mpirun or submitit it is one rank of the job.
"""
from __future__ import annotations

import os
import time
import sys

from hpcnft.common import collector
from hpcnft.common.errors import EXIT_BAD_INPUT, EXIT_PREEMPTED, UsageError
from hpcnft.distributed.config import local_world_size
from hpcnft.run.rundir import (check_existing_run, check_input, default_run_dir, finished_line, lock_run_dir,
                               resume_command, tiny_models_needed)


def add_arguments(name: str, p) -> None:
    if name == "make-tiny":
        p.add_argument("dir", help="output folder; receives sd35_tiny/, flux1_tiny/, pickscore_tiny/ and the "
                                   "reward terms' tiny models (clip_l_tiny/, aesthetic_tiny/, hpsv2_tiny/)")
        return
    from hpcnft.common.recipe_files import recipe_names

    p.add_argument("recipe", nargs="?", default="tiny",
                   help=f"recipe name ({', '.join(recipe_names())}; default tiny) or a TOML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config value, e.g. --set optim.lr=1e-4 (repeatable)")
    p.add_argument("--run-dir", help="where run.h5, checkpoints, logs and samples go")
    p.add_argument("--steps", type=int, help="run until this step (a resumed run may extend it)")


def main(name: str, args) -> int:
    if name == "make-tiny":
        from hpcnft.models.tiny import build_tiny_models, tree_digest

        import shutil

        from hpcnft.rewards.registry import tiny_term_builders

        from hpcnft.models.families import FLUX

        built = list(build_tiny_models(args.dir))
        for name, build in {FLUX.tiny_dirname: FLUX.build_tiny, **tiny_term_builders()}.items():
            folder = os.path.join(args.dir, name)
            shutil.rmtree(folder, ignore_errors=True)
            os.makedirs(folder)
            build(folder)
            built.append(folder)
        for folder in built:
            print(f"{folder}  sha256 {tree_digest(folder)}")
        return 0
    return start(args)


def start(args) -> int:
    from hpcnft.algo.root_config import ConfigError, load_config
    from hpcnft.distributed.detect import detect
    from hpcnft.distributed.launch import LaunchError
    from hpcnft.run.estimate import print_startup_notes

    try:
        cfg = load_config(args.recipe, args.overrides, steps=args.steps, run_dir=args.run_dir)
        info = detect(os.environ)
        print_startup_notes(cfg, args.recipe, info)  # a recipe file's base; a step that will be long
    except (ConfigError, LaunchError) as e:
        raise UsageError(str(e)) from None
    if info.launcher == "none" and not os.environ.get("HPCNFT_LAUNCHER"):
        collector.settle()
        return spawn(cfg, args)
    from hpcnft.run.entry import rank_main

    return rank_main(cfg, info, args.recipe, args.overrides)


def spawn(cfg, args) -> int:
    """No launcher: check the input, take the run dir, build the tiny models once, then start the
    ranks. This process holds the run dir's lock while the ranks run and hands it to rank 0, so
    a second start is refused before it spawns anything."""
    from hpcnft.io.rundir_lock import INHERITED_FD_ENV, RunDirInUse

    os.umask(int(cfg.umask, 8))  # run dirs and files: private to the user by default (077)
    cfg.run_dir = cfg.run_dir or default_run_dir(args.recipe)
    check_input(cfg, local_world_size(cfg))
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
        if finished is not None:  # said before any model loads
            print(f"hpcnft: {finished_line(cfg.run_dir, finished)}", flush=True)
            return 0
        return spawn_ranks(cfg, args, rank0_fd=(INHERITED_FD_ENV, lock.fd))
    finally:
        lock.release()


def spawn_ranks(cfg, args, rank0_fd) -> int:
    from hpcnft.distributed import groups, preempt

    built_here = tiny_models_needed(cfg)
    if built_here:
        from hpcnft.models.loading import resolve_model_paths

        t0 = time.perf_counter()
        print("hpcnft: building the tiny models (once, into the cache)", flush=True)
        resolve_model_paths(cfg)  # build them once here rather than in every rank
        print(f"hpcnft: tiny models built in {time.perf_counter() - t0:.1f} s", flush=True)
    world = local_world_size(cfg)
    train, reward = groups.roles(world, cfg.layout.reward_ranks)
    argv = ["run", args.recipe, "--run-dir", cfg.run_dir, *sum((["--set", o] for o in args.overrides), [])]
    if args.steps is not None:
        argv += ["--steps", str(args.steps)]
    print(f"hpcnft: run dir {cfg.run_dir} | {world} rank(s): train {train}, reward {reward or 'colocated'}",
          flush=True)
    # Building the tiny models ran torch here: then the ranks start as new interpreters.
    entry = rank_entry(cfg) if groups.ranks_can_fork(cfg) and not built_here else None
    early = preempt.early_signal()
    if early:
        print(f"hpcnft: {early} before the ranks started: nothing to save", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    from hpcnft.run.failures import FailureClaim

    claim = FailureClaim(cfg.run_dir)
    claim.clear()
    resume = resume_command(args.recipe, args.overrides, cfg.run_dir, cfg.steps)
    code = groups.spawn_local(argv, world, lambda r: "reward" if r in reward else "train", rank0_fd=rank0_fd,
                              entry=entry, resume_hint=f"`{resume}`", failure_claim=claim)
    sys.stdout.flush()
    return code


def rank_entry(cfg):
    """Import what every rank of this job imports, once, for ranks forked from this process
    (distributed.groups.ForkedRank); returns the command line's main, which they run."""
    from hpcnft.cli.main import main
    from hpcnft.models.loading import import_libraries
    import hpcnft.run.entry  # noqa: F401 - the rank's own modules

    collector.hold_off()
    import_libraries(cfg)
    collector.settle()  # frozen: the ranks' collections never walk (nor copy) the shared objects
    return main
