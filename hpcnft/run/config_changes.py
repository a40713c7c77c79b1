"""What may change between a checkpoint's config and the config of a start that resumes from it:
settings compared key by key (a list of tables per entry: reward.terms[1].weight), the keys a
resume may change silently or with a warning, and one bounded line describing the changes."""
from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass

from hpcnft.algo.root_config import Config
from hpcnft.common.config import _type_of, keys_on_resume
from hpcnft.common.validation import flatten

# The keys a resume may change (run length, where to write, how to wait, how the job is laid out),
# and those it may change with a warning (where, how patiently and with which secret a remote
# term asks, not what it scores): each declared beside the key (`setting(..., on_resume=...)`).
RESUME_MUTABLE_KEYS = keys_on_resume(Config, "free")
RESUME_WARNED_KEYS = keys_on_resume(Config, "warn")
CHANGES_LISTED = 5  # a refusal or warning names at most this many keys, and counts the rest
CHANGE_TEXT_CHARS = 40  # of each key and value in it


@dataclass(frozen=True)
class Change:
    """A setting that differs between two configs: its key (reward.terms[0].weight) and values
    (None where one config lacks the key)."""
    key: str
    old: object
    new: object

    def __str__(self) -> str:
        return f"{_clip(self.key)} ({_clip(repr(self.old))} -> {_clip(repr(self.new))})"


class _Count(int):
    """The length of a list of tables, as a change shows it."""

    def __repr__(self) -> str:
        return f"{int(self)} {'entry' if self == 1 else 'entries'}"


def _clip(text: str) -> str:
    return text if len(text) <= CHANGE_TEXT_CHARS else text[:CHANGE_TEXT_CHARS - 3] + "..."


def _table_lists(cls=Config, prefix: str = "") -> set[str]:
    """The keys whose value is a list of tables (reward.terms)."""
    out = set()
    for f in dataclasses.fields(cls):
        typ = _type_of(cls, f.name)
        if dataclasses.is_dataclass(typ):
            out |= _table_lists(typ, f"{prefix}{f.name}.")
        elif typing.get_origin(typ) is list and dataclasses.is_dataclass(typing.get_args(typ)[0]):
            out.add(prefix + f.name)
    return out


def _index_order(key: str) -> str:
    return re.sub(r"\[(\d+)\]", lambda m: f"[{int(m[1]):09d}]", key)


def config_changes(a: dict, b: dict, ignore: set[str] = RESUME_MUTABLE_KEYS) -> list[Change]:
    """The settings that differ from config `a` to `b` (as dicts), but those in `ignore`, in key
    order. A list of tables is compared per entry and key (reward.terms[1].weight); when the
    number of entries differs, that number is the change. A key that `a`, the older config, lacks
    is read as its default (`algo.name`, `[grpo]`: a run made before a key existed ran as its
    default does)."""
    fa, fb = flatten(a), flatten(b)
    defaults = flatten(Config().to_dict())
    tables = _table_lists()
    changes = []
    for key in set(fa) | set(fb):
        if key in ignore:
            continue
        old, new = fa.get(key, defaults.get(key)), fb.get(key)
        if key in tables and isinstance(old, list) and isinstance(new, list):
            if len(old) != len(new):
                changes.append(Change(key, _Count(len(old)), _Count(len(new))))
                continue
            for i, (x, y) in enumerate(zip(old, new)):
                if isinstance(x, dict) and isinstance(y, dict):
                    changes += [Change(f"{key}[{i}].{c.key}", c.old, c.new) for c in config_changes(x, y, set())]
                elif x != y:
                    changes.append(Change(f"{key}[{i}]", x, y))
        elif old != new:
            changes.append(Change(key, old, new))
    return sorted(changes, key=lambda c: _index_order(c.key))


def warned_on_resume(key: str) -> bool:
    """Whether `key` (reward.terms[0].url) may change on resume, with a warning."""
    return re.sub(r"\[\d+\]", "[]", key) in RESUME_WARNED_KEYS


def describe_changes(changes: list[Change]) -> str:
    """`key (old -> new), ...`: one line of bounded length, listing at most CHANGES_LISTED."""
    text = ", ".join(str(c) for c in changes[:CHANGES_LISTED])
    more = len(changes) - CHANGES_LISTED
    return text + (f" and {more} more" if more > 0 else "")


def differing_keys(a: dict, b: dict, ignore: set[str] = RESUME_MUTABLE_KEYS) -> list[str]:
    """The keys that differ between configs `a` and `b` and may not on resume: all but `ignore`
    and the warned ones (RESUME_WARNED_KEYS)."""
    return [c.key for c in config_changes(a, b, ignore) if not warned_on_resume(c.key)]


def resume_refusal(run_dir: str, changes: list[Change]) -> str:
    """The line refusing a resume whose config changed what is scored or trained ("" if none
    did): said by the starting process, or by rank 0 under a launcher."""
    refused = [c for c in changes if not warned_on_resume(c.key)]
    return (f"cannot resume {run_dir}: the config differs from its checkpoint in {describe_changes(refused)}"
            if refused else "")
