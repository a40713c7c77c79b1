"""The run dir and the input checks made once before any rank starts: its default name, that
it can be written, that no other run owns it, that a run already in it may be resumed with this
config, and that the prompt files and model folders are there."""
from __future__ import annotations

import os
import re
import sys
import shlex
import time

from hpcnft.common.errors import UsageError


def preflight(cfg, world_size: int | None = None) -> None:
    """Bad input found before any rank starts: raise UsageError with one line."""
    check_input(cfg, world_size)
    check_existing_run(cfg)


def check_input(cfg, world_size: int | None = None) -> None:
    """preflight's checks that do not read the run dir's contents (a run that holds the run dir
    may be writing them); the layout's against `world_size` when the job's size is known."""
    from hpcnft.io.prompt_files import PromptFileError, read_prompt_file
    from hpcnft.common.errors import ConfigError
    from hpcnft.distributed.config import check_layout

    if world_size is not None:
        try:
            check_layout(cfg, world_size)
        except ConfigError as e:
            raise UsageError(str(e)) from None
    from hpcnft.models.folders import BASE_REQUIRED, PICKSCORE_REQUIRED, PROCESSOR_REQUIRED, ModelError, check_folder

    try:
        train = read_prompt_file(cfg.data.train_prompts, "data.train_prompts")
        cfg.reward.check_prompts(train, read_prompt_file(cfg.data.eval_prompts, "data.eval_prompts"))
        m = cfg.models
        for family, required in BASE_REQUIRED.items():
            folder = getattr(m, f"{family}_dir")
            if folder:
                check_folder(f"models.{family}_dir", folder, required)
        if m.pickscore_dir:
            check_folder("models.pickscore_dir", m.pickscore_dir, PICKSCORE_REQUIRED)
        if m.pickscore_processor_dir or m.pickscore_dir:
            check_folder("models.pickscore_processor_dir", m.pickscore_processor_dir or m.pickscore_dir,
                         PROCESSOR_REQUIRED)
    except (ModelError, PromptFileError, ConfigError) as e:
        raise UsageError(str(e)) from None
    check_trackers(cfg)
    check_term_extras(cfg)
    check_memory_budget(cfg)
    try:  # the folders' contents after what the config alone decides
        check_model_files(cfg)
    except ModelError as e:
        raise UsageError(str(e)) from None
    check_run_dir(cfg.run_dir)


def check_model_files(cfg) -> None:
    """The configured model folders' own files agree (shards, tokenizers; JSON only, no torch):
    a missing shard or a foreign tokenizer is refused here, before any rank starts."""
    from hpcnft.models.folder_check import check_files, check_processor

    from hpcnft.models.tiny_cache import base_dir

    m = cfg.models
    base = base_dir(m)
    if base:
        check_files(f"models.{m.family}_dir", base)
    if m.pickscore_dir:
        check_files("models.pickscore_dir", m.pickscore_dir)
        check_processor("models.pickscore_processor_dir", m.pickscore_processor_dir or m.pickscore_dir,
                        m.pickscore_dir)


def check_memory_budget(cfg) -> None:
    """perf.memory_budget_gib against what the bench measured for the base model (hpcnft.perf.
    memory), read from its folder's config: refused in one line, or a note, before any model loads."""
    if not cfg.perf.memory_budget_gib:
        return
    from hpcnft.models.folders import real_model
    from hpcnft.perf import memory

    from hpcnft.models.tiny_cache import base_dir

    folder = base_dir(cfg.models)
    model = real_model(folder) if folder else ""
    refusal, note = memory.check_budget(memory.settings_of(cfg), model or "these models", cfg.perf.memory_budget_gib,
                                        memory.rungs(model))
    if refusal:
        raise UsageError(refusal)
    if note:
        print(f"hpcnft: {note}", file=sys.stderr, flush=True)


def lock_run_dir(run_dir: str, warn, inherited: bool = False):
    """Make this process the run dir's owner (io.rundir_lock): returns the held lock; raises
    RunDirInUse (a UsageError naming the holder) or UsageError when the lock cannot be opened.
    `inherited`: rank 0 takes over the lock its local spawner passed down, if it did."""
    from hpcnft.io import rundir_lock

    try:
        return rundir_lock.take(run_dir, warn) if inherited else rundir_lock.acquire(run_dir, warn)
    except OSError as e:
        raise UsageError(f"run dir {run_dir!r}: cannot take its lock file: {e.strerror or e}") from None


def check_term_extras(cfg) -> None:
    """Every reward term has its extra's packages installed (the ocr term: hpcnft[ocr])."""
    problem = cfg.reward.missing_extra()
    if problem:
        raise UsageError(problem)


def check_trackers(cfg) -> None:
    """Every tracker of logging.trackers has its package installed."""
    from hpcnft.io.trackers import missing_package

    for name in cfg.logging.trackers:
        problem = missing_package(name)
        if problem:
            raise UsageError(problem)


def resume_command(recipe: str, overrides, run_dir: str, steps: int) -> str:
    """The command that resumes this run: its recipe, overrides and step count, and its run dir
    named (an auto-named one is not chosen again), quoted for a POSIX shell."""
    sets = [word for item in overrides for word in ("--set", item)]
    return shlex.join(["hpcnft", "run", recipe, "--run-dir", run_dir, *sets, "--steps", str(steps)])


def default_run_dir(recipe: str) -> str:
    name = os.path.splitext(os.path.basename(recipe))[0]
    return os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")


def tiny_models_needed(cfg) -> bool:
    """Whether this config uses a tiny model that is not built yet (without importing torch)."""
    from hpcnft.models.tiny_cache import FAMILY_DIRNAMES, built, tiny_cache, tiny_models_used

    cache = tiny_cache(cfg)
    sd3_and_pickscore, own = tiny_models_used(cfg)
    return (sd3_and_pickscore and not built(cache)) or \
        (own and not built(os.path.join(cache, FAMILY_DIRNAMES[cfg.models.family])))


def last_checkpoint_step(run_dir: str) -> int | None:
    """The step of the newest committed checkpoint in the run dir (its COMPLETE marker written),
    read without torch; None when there is none. Whether it loads is rank 0's to find out."""
    root = os.path.join(run_dir, "checkpoints")
    try:
        names = os.listdir(root)
    except OSError:
        return None
    steps = [int(m[1]) for name in names if (m := re.fullmatch(r"step_(\d{6,})", name))
             and os.path.isfile(os.path.join(root, name, "COMPLETE"))]
    return max(steps, default=None)


def resume_line(run_dir: str, resume: str) -> str:
    """After a failure: the command that goes on, and from where."""
    step = last_checkpoint_step(run_dir)
    if step is None:
        return f"no checkpoint was written: `{resume}` starts the run over"
    return f"`{resume}` resumes it from checkpoint step {step}"


def finished_line(run_dir: str, step: int) -> str:
    return f"{run_dir} already finished at step {step}; nothing to run (--steps N with N > {step} continues it)"


def check_existing_run(cfg) -> str:
    """What the starting process decides of a run dir that already holds a run, without torch:
    the line saying the run is finished ("" if not). With no checkpoint, a readable run.h5 there
    must be a run file of this config, which the run appends to (an unreadable one is set aside
    by rank 0: resume.agree_plan). With checkpoints, the newest committed one as files
    (io.checkpoint_dirs) decides what needs no rank: a config that changed what is scored or
    trained is refused, and a run whose checkpoint reached `steps` with a run.h5 that carries on
    from it is finished. What needs torch (a checkpoint's shards, rebuilding run.h5) is rank 0's."""
    from hpcnft.common.errors import ConfigError
    from hpcnft.io.checkpoint_dirs import checkpoint_root, newest_committed, read_json
    from hpcnft.io.run_state import RUN_ID, run_file_trouble, run_state_path
    from hpcnft.io.runfile import RunFileError, read_run
    from hpcnft.run.config_changes import config_changes, differing_keys, resume_refusal

    path = os.path.join(cfg.run_dir, "run.h5")
    if os.path.isdir(checkpoint_root(cfg.run_dir)):
        found = newest_committed(cfg.run_dir)
        if found is None:
            return ""
        refusal = resume_refusal(cfg.run_dir, config_changes(read_json(found[1], "config.json"), cfg.to_dict()))
        if refusal:
            raise UsageError(refusal)
        if found[0] < cfg.steps:
            return ""
        try:
            run_id = read_run(run_state_path(found[1])).attrs.get(RUN_ID)
        except (RunFileError, ConfigError, OSError):
            return ""  # rank 0 finds a checkpoint it can rebuild from, or says why not
        why, _ = run_file_trouble(path, run_id, found[0])
        return "" if why else finished_line(cfg.run_dir, found[0])
    if not os.path.lexists(path):
        return ""
    try:
        stored = read_run(path).config  # the run appends to it: it must be a run file of this schema
    except RunFileError:
        return ""  # damaged (a write that failed halfway): rank 0 sets it aside and starts over
    except ConfigError as e:
        raise UsageError(str(e)) from None
    diff = differing_keys(stored, cfg.to_dict())
    if diff:
        raise UsageError(f"run dir {cfg.run_dir!r} holds a run with another config "
                         f"({', '.join(diff[:5])}); choose another --run-dir")
    return ""


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
