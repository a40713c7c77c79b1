"""Which checkpoint a run resumes from: the newest usable one, refused when the config differs,
and agreed on by every train rank."""
from __future__ import annotations

import torch.distributed as dist

from hpcnft.common.config import Config, ConfigError, differing_keys, flatten
from hpcnft.io import checkpoint


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
