"""`hpcnft run` and `hpcnft make-tiny`.

`run` checks its input once, up front (config, prompt files, model folders, run dir), so bad
input is one line and exit 2 before any rank starts. With no launcher in the environment it
spawns the layout's ranks as local processes; under torchrun, srun, mpirun or submitit it is
one rank of the job.
"""
from __future__ import annotations

import os
import sys
import time

from hpcnft.cli import UsageError


def add_arguments(name: str, p) -> None:
    if name == "make-tiny":
        p.add_argument("dir", help="output folder; receives sd35_tiny/ and pickscore_tiny/")
        return
    from hpcnft.config import recipe_names

    p.add_argument("recipe", nargs="?", default="tiny",
                   help=f"recipe name ({', '.join(recipe_names())}; default tiny) or a TOML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config value, e.g. --set optim.lr=1e-4 (repeatable)")
    p.add_argument("--run-dir", help="where run.h5, checkpoints, logs and samples go")
    p.add_argument("--steps", type=int, help="run until this step (a resumed run may extend it)")


def main(name: str, args) -> int:
    if name == "make-tiny":
        from hpcnft.tiny import build_tiny_models, tree_digest

        sd3, ps = build_tiny_models(args.dir)
        print(f"{sd3}  sha256 {tree_digest(sd3)}")
        print(f"{ps}  sha256 {tree_digest(ps)}")
        return 0
    return run(args)


def preflight(cfg) -> None:
    """Bad input found before any rank starts: raise UsageError with one line."""
    from hpcnft.models import (PICKSCORE_REQUIRED, PROCESSOR_REQUIRED, SD3_REQUIRED, ModelError, check_folder)
    from hpcnft.prompts import PromptFileError, read_prompt_file

    try:
        read_prompt_file(cfg.data.train_prompts, "data.train_prompts")
        read_prompt_file(cfg.data.eval_prompts, "data.eval_prompts")
        m = cfg.models
        if m.sd3_dir:
            check_folder("models.sd3_dir", m.sd3_dir, SD3_REQUIRED)
        if m.pickscore_dir:
            check_folder("models.pickscore_dir", m.pickscore_dir, PICKSCORE_REQUIRED)
        if m.pickscore_processor_dir or m.pickscore_dir:
            check_folder("models.pickscore_processor_dir", m.pickscore_processor_dir or m.pickscore_dir,
                         PROCESSOR_REQUIRED)
    except (ModelError, PromptFileError) as e:
        raise UsageError(str(e)) from None
    check_run_dir(cfg.run_dir)
    check_existing_run(cfg)
    check_backend(cfg)


def check_backend(cfg) -> None:
    """The backend the ranks will choose on this machine must suit the layout's options."""
    import torch

    from hpcnft.config import ConfigError
    from hpcnft.distributed import resolve_backend

    gpu = cfg.layout.device != "cpu" and torch.cuda.is_available()
    try:
        resolve_backend(cfg, torch.device("cuda" if gpu else "cpu"))
    except ConfigError as e:
        raise UsageError(str(e)) from None


def default_run_dir(recipe: str) -> str:
    name = os.path.splitext(os.path.basename(recipe))[0]
    return os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")


def tiny_models_built(cfg) -> bool:
    from hpcnft.tiny_cache import built, cache_dir

    return built(cfg.models.tiny_cache or cache_dir())


def check_existing_run(cfg) -> None:
    """A run dir that already holds a run may only be resumed with a compatible config."""
    from hpcnft.config import ConfigError, differing_keys
    from hpcnft.runfile import RunFileError, read_run

    try:
        resumable = False
        if os.path.isdir(os.path.join(cfg.run_dir, "checkpoints")):
            from hpcnft.runner import check_resumable

            resumable = check_resumable(cfg, cfg.run_dir, warn=lambda _text: None) is not None
        path = os.path.join(cfg.run_dir, "run.h5")
        if os.path.lexists(path):
            stored = read_run(path).config  # the run appends to it: it must be a run file of this schema
            diff = [] if resumable else differing_keys(stored, cfg.to_dict())
            if diff:
                raise UsageError(f"run dir {cfg.run_dir!r} holds a run with another config "
                                 f"({', '.join(diff[:5])}); choose another --run-dir")
    except ConfigError as e:
        raise UsageError(str(e)) from None
    except RunFileError as e:
        raise UsageError(f"run dir {cfg.run_dir!r}: {e}") from None


def check_run_dir(path: str) -> None:
    if not path:
        return
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(os.path.abspath(probe))
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise UsageError(f"run dir {path!r}: {probe!r} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"run dir {path!r} is not writable")


def run(args) -> int:
    from hpcnft.config import ConfigError, load_config
    from hpcnft.launch import LaunchError, detect

    try:
        cfg = load_config(args.recipe, args.overrides, steps=args.steps, run_dir=args.run_dir)
        info = detect(os.environ)
    except (ConfigError, LaunchError) as e:
        raise UsageError(str(e)) from None
    if info.launcher == "none" and not os.environ.get("HPCNFT_LAUNCHER"):
        return spawn(cfg, args)
    from hpcnft.runner import run_rank

    return run_rank(cfg, info, args.recipe)


def spawn(cfg, args) -> int:
    """No launcher: check the input, build the tiny models once, then start the ranks."""
    from hpcnft import distributed

    os.umask(int(cfg.umask, 8))  # run dirs and files: private to the user by default (077)
    cfg.run_dir = cfg.run_dir or default_run_dir(args.recipe)
    preflight(cfg)
    try:
        os.makedirs(cfg.run_dir, mode=0o700, exist_ok=True)
    except OSError as e:
        raise UsageError(f"run dir {cfg.run_dir!r}: {e.strerror}") from None
    if (not cfg.models.sd3_dir or not cfg.models.pickscore_dir) and not tiny_models_built(cfg):
        from hpcnft.models import resolve_model_paths

        resolve_model_paths(cfg)  # build them once here rather than in every rank
    world = 1 if cfg.layout.reward_ranks == 0 and cfg.layout.train_ranks == 1 else \
        cfg.layout.train_ranks + cfg.layout.reward_ranks
    train, reward = distributed.roles(world, cfg.layout.reward_ranks)
    argv = ["run", args.recipe, "--run-dir", cfg.run_dir, *sum((["--set", o] for o in args.overrides), [])]
    if args.steps is not None:
        argv += ["--steps", str(args.steps)]
    print(f"hpcnft: run dir {cfg.run_dir} | {world} rank(s): train {train}, reward {reward or 'colocated'}",
          flush=True)
    code = distributed.spawn_local(argv, world, lambda r: "reward" if r in reward else "train")
    sys.stdout.flush()
    return code
