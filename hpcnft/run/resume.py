"""Which checkpoint a run resumes from: the newest usable one, refused when the config differs,
and agreed on by every rank; and whether run.h5 must first be rebuilt from a checkpoint's
copy of it (deleted, damaged, another run's, or ending before the checkpoint)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch.distributed as dist

from hpcnft.algo.root_config import Config, ConfigError
from hpcnft.common.errors import one_line
from hpcnft.io import checkpoint, run_state
from hpcnft.io.run_state import run_file_trouble
from hpcnft.io.runfile import read_run
from hpcnft.run.config_changes import config_changes, describe_changes, resume_refusal


def _listed(value) -> list:
    """A topology attribute that holds a list (run.h5 keeps lists as JSON text)."""
    return json.loads(value) if isinstance(value, str) else list(value)


def _layout(topology: dict) -> str:
    train, reward = _listed(topology.get("train_ranks", [])), _listed(topology.get("reward_ranks", []))
    hosts = sorted(set(_listed(topology.get("hosts", []))))
    ranks = f"{len(train)} train + {len(reward)} reward ranks" if reward else f"{len(train)} train rank(s), colocated"
    return f"{ranks} on {len(hosts)} host(s) ({', '.join(hosts)})" if hosts else ranks


def layout_change(before: dict, now: dict) -> str:
    """The line saying that a resume runs on another layout than the start before it (the
    numbers of train and reward ranks, the hosts), "" when it does not or nothing was recorded.
    The checkpoint is resharded onto the new train ranks (torch.distributed.checkpoint)."""
    if not before or "train_ranks" not in before:
        return ""
    old, new = _layout(before), _layout(now)
    return f"resuming on another layout: {old} -> {new}" if old != new else ""


class RunFileLostError(Exception):
    """run.h5 cannot be used and no checkpoint holds a copy to rebuild it from (one line)."""


@dataclass
class ResumePlan:
    checkpoint: tuple[int, str] | None  # (step, path) the ranks resume from; None: start at step 0
    rebuild_why: str = ""  # why run.h5 is rebuilt from the checkpoint's run_state.h5; "" = kept as it is
    aside_tag: str = ""  # the existing run.h5 is renamed run.h5.<tag>-<time>; "" = there is none
    warnings: list[str] = field(default_factory=list)  # checkpoints skipped and why


def agree_plan(cfg: Config, rank: int) -> ResumePlan:
    """Rank 0's plan on every rank of the job, so that train and reward ranks resume from one
    checkpoint; rank 0's ConfigError or RunFileLostError (any other failure as a RuntimeError)
    is raised on every rank."""
    outcome = None
    if rank == 0:
        warnings: list[str] = []
        try:
            plan = plan_resume(cfg, cfg.run_dir, warnings.append)
            plan.warnings = warnings
            outcome = (plan, None)
        except (ConfigError, RunFileLostError) as e:
            outcome = (None, e)
        except Exception as e:  # noqa: BLE001 - the other ranks must not wait for a plan that never comes
            outcome = (None, RuntimeError(one_line(e)))
    box = [outcome]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    plan, error = box[0]
    if error is not None:
        raise error
    return plan


def _check_config(cfg: Config, run_dir: str, path: str) -> str:
    """Refuse (ConfigError naming each key) a config that differs from checkpoint `path`'s in
    what is scored or trained; the warning about the settings that may change (where and how
    patiently a remote term asks), "" when none did."""
    changes = config_changes(checkpoint.read_json(path, "config.json"), cfg.to_dict())
    refusal = resume_refusal(run_dir, changes)
    if refusal:
        raise ConfigError(refusal)
    if not changes:
        return ""
    return (f"resuming with settings changed since checkpoint {path}: {describe_changes(changes)} (a remote "
            f"term's endpoint must score as the old one did for the run to stay comparable)")


def check_resumable(cfg: Config, run_dir: str, warn) -> tuple[int, str] | None:
    """The checkpoint to resume from, refusing one whose config differs (ConfigError); `warn`
    gets the checkpoints skipped and the settings that changed where they may."""
    found = checkpoint.latest_usable(run_dir, warn)
    if found is not None:
        changed = _check_config(cfg, run_dir, found[1])
        if changed:
            warn(changed)
    return found


def _rebuild_source(run_dir: str, found: tuple[int, str]):
    """The newest usable checkpoint, not newer than `found`, whose run_state.h5 can rebuild
    run.h5, and [(path, why)] of the newer ones whose copy cannot."""
    skipped = []
    for step, path in reversed(checkpoint.list_checkpoints(run_dir)):
        if step > found[0] or (step < found[0] and checkpoint.problems(path) is not None):
            continue
        why = run_state.problems(path, step)
        if why is None:
            return (step, path), skipped
        skipped.append((path, why))
    return None, skipped


def _fresh_start(run_dir: str) -> ResumePlan:
    """No checkpoint: the run starts over, appending to a readable run.h5 (its rows dropped), or
    setting a damaged one aside (a write that failed halfway, say) to start a new one."""
    why, tag = run_file_trouble(os.path.join(run_dir, "run.h5"), None, 0)
    return ResumePlan(None, why, tag) if tag == "damaged" else ResumePlan(None)


def plan_resume(cfg: Config, run_dir: str, warn) -> ResumePlan:
    """Where the run resumes and whether run.h5 is rebuilt first. Raises ConfigError (another
    config) and RunFileLostError (run.h5 unusable, nothing to rebuild it from)."""
    found = checkpoint.latest_usable(run_dir, warn)
    if found is None:
        return _fresh_start(run_dir)
    changed = _check_config(cfg, run_dir, found[1])
    source, skipped = _rebuild_source(run_dir, found)
    run_id = read_run(run_state.run_state_path(source[1])).attrs.get(run_state.RUN_ID) if source else None
    run_h5 = os.path.join(run_dir, "run.h5")
    why, tag = run_file_trouble(run_h5, run_id, found[0])
    if not why:
        if changed:
            warn(changed)
        return ResumePlan(found)
    if source is None:
        reason = f" ({skipped[0][1]})" if skipped else ""
        raise RunFileLostError(f"run dir {run_dir!r}: run.h5 {why}, and no checkpoint holds a copy to rebuild it "
                               f"from{reason}; restore run.h5 (e.g. from a backup), or start over with another "
                               f"--run-dir")
    for path, reason in skipped:
        warn(f"skipping checkpoint {path} for rebuilding run.h5: {reason}")
    if source != found:  # the settings changed are those since the checkpoint resumed from
        changed = _check_config(cfg, run_dir, source[1])
    if changed:
        warn(changed)
    return ResumePlan(source, why, tag)
