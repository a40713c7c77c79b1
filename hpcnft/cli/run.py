"""`hpcnft run` and `hpcnft make-tiny`.

`run` checks its input once, up front (config, prompt files, model folders, run dir), so bad
input is one line and exit 2 before any rank starts. With no launcher in the environment it
spawns the layout's ranks as local processes; under torchrun, srun, mpirun or submitit it is
one rank of the job.
"""
from __future__ import annotations

import os
import time
import sys

from hpcnft.common.errors import UsageError
from hpcnft.run.rundir import default_run_dir, preflight, tiny_models_built


def add_arguments(name: str, p) -> None:
    if name == "make-tiny":
        p.add_argument("dir", help="output folder; receives sd35_tiny/ and pickscore_tiny/")
        return
    from hpcnft.common.config import recipe_names

    p.add_argument("recipe", nargs="?", default="tiny",
                   help=f"recipe name ({', '.join(recipe_names())}; default tiny) or a TOML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config value, e.g. --set optim.lr=1e-4 (repeatable)")
    p.add_argument("--run-dir", help="where run.h5, checkpoints, logs and samples go")
    p.add_argument("--steps", type=int, help="run until this step (a resumed run may extend it)")


def main(name: str, args) -> int:
    if name == "make-tiny":
        from hpcnft.models.tiny import build_tiny_models, tree_digest

        sd3, ps = build_tiny_models(args.dir)
        print(f"{sd3}  sha256 {tree_digest(sd3)}")
        print(f"{ps}  sha256 {tree_digest(ps)}")
        return 0
    return start(args)


def start(args) -> int:
    from hpcnft.common.config import ConfigError, load_config
    from hpcnft.dist.detect import detect
    from hpcnft.dist.launch import LaunchError

    try:
        cfg = load_config(args.recipe, args.overrides, steps=args.steps, run_dir=args.run_dir)
        info = detect(os.environ)
    except (ConfigError, LaunchError) as e:
        raise UsageError(str(e)) from None
    if info.launcher == "none" and not os.environ.get("HPCNFT_LAUNCHER"):
        return spawn(cfg, args)
    from hpcnft.run.entry import rank_main

    return rank_main(cfg, info, args.recipe)


def spawn(cfg, args) -> int:
    """No launcher: check the input, build the tiny models once, then start the ranks."""
    from hpcnft.dist import groups

    os.umask(int(cfg.umask, 8))  # run dirs and files: private to the user by default (077)
    cfg.run_dir = cfg.run_dir or default_run_dir(args.recipe)
    preflight(cfg)
    try:
        os.makedirs(cfg.run_dir, mode=0o700, exist_ok=True)
    except OSError as e:
        raise UsageError(f"run dir {cfg.run_dir!r}: {e.strerror}") from None
    if (not cfg.models.sd3_dir or not cfg.models.pickscore_dir) and not tiny_models_built(cfg):
        from hpcnft.models.loading import resolve_model_paths

        t0 = time.perf_counter()
        print("hpcnft: building the tiny models (once, into the cache)", flush=True)
        resolve_model_paths(cfg)  # build them once here rather than in every rank
        print(f"hpcnft: tiny models built in {time.perf_counter() - t0:.1f} s", flush=True)
    world = 1 if cfg.layout.reward_ranks == 0 and cfg.layout.train_ranks == 1 else \
        cfg.layout.train_ranks + cfg.layout.reward_ranks
    train, reward = groups.roles(world, cfg.layout.reward_ranks)
    argv = ["run", args.recipe, "--run-dir", cfg.run_dir, *sum((["--set", o] for o in args.overrides), [])]
    if args.steps is not None:
        argv += ["--steps", str(args.steps)]
    print(f"hpcnft: run dir {cfg.run_dir} | {world} rank(s): train {train}, reward {reward or 'colocated'}",
          flush=True)
    code = groups.spawn_local(argv, world, lambda r: "reward" if r in reward else "train")
    sys.stdout.flush()
    return code
