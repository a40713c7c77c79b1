"""The checks every config gets, whatever its sections: each key against the rule its `setting`
declares (one of the owner's choices, a bound, an upper limit), no NUL or newline in any string;
then each section's own checks (its `check()` method) and last the root's, across sections.

The rules' vocabularies are their owners': a section's `setting(choices=...)` names the tuple its
package defines (hpcnft/algo/config.py, hpcnft/perf/config.py, ...)."""
from __future__ import annotations

import dataclasses
import math

from hpcnft.common.errors import ConfigError


BOUND_CHECKS = (("> 0", lambda v: v > 0, "> 0"), (">= 0", lambda v: v >= 0, ">= 0"),
                ("[0, 1]", lambda v: 0 <= v <= 1, "within [0, 1]"))


def flatten(d: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def settings(obj, prefix: str = ""):
    """(key, field, value) of the keys of `obj` and of its sections, in declaration order (the
    entries of a list of tables, reward.terms, are their section's to check)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from settings(value, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, f, value


def sections(obj):
    """The sections of `obj` (its tables of settings), depth first, in declaration order."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield value
            yield from sections(value)


def _check_rules(keys: list) -> None:
    for key, f, value in keys:
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(choices)}")
    for key, f, value in keys:
        if (f.metadata.get("bounds") and isinstance(value, float) and not math.isfinite(value)
                and not f.metadata.get("infinite")):
            raise ConfigError(f"{key}: must be a finite number, got {value!r}")
    for bound, holds, words in BOUND_CHECKS:  # every key's "> 0" first, then ">= 0", then "[0, 1]"
        for key, f, value in keys:
            if bound in f.metadata.get("bounds", ()) and not holds(value):
                raise ConfigError(f"{key}: must be {words}, got {value!r}")
    for key, f, value in keys:
        limit = f.metadata.get("at_most")
        if limit is not None:
            at_most(key, value, limit)


def at_most(key: str, value, limit) -> None:
    if not value <= limit:
        raise ConfigError(f"{key}: must be <= {limit:g}, got {value!r}")


def check(cfg) -> None:
    """Refuse a config (ConfigError naming the key) that no run could use."""
    keys = list(settings(cfg))
    _check_rules(keys)
    for key, _, value in keys:
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, str) and ("\0" in v or "\n" in v) for v in values):
            raise ConfigError(f"{key}: must not contain NUL or newline characters")
    for part in (*sections(cfg), cfg):
        if hasattr(part, "check"):
            part.check()
