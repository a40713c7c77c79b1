"""The config machinery: sections as dataclasses whose keys are `setting`s, TOML recipes and
`--set key=value` overrides applied onto a root of sections, each key documented once.

A section lives beside its owner (`hpcnft/<package>/config.py`: `[rollout]`, `[nft]` ... in algo,
`[perf]` in perf, `[layout]` in distributed, ...); the root that assembles them, with
`load_config`, is `hpcnft.algo.root_config`. A recipe (read by hpcnft.common.recipe_files) is a
TOML file whose tables mirror the sections (`[optim] lr = 3e-4`). `--set optim.lr=1e-3`
overrides one value; the value is read as a TOML literal, so `--set layout.train_ranks=1`,
`--set train.finetune="full"` and `--set train.finetune=full` work. Unknown keys, wrong types and
out-of-range values are refused with a message naming the key (hpcnft.common.validation).

Each key is declared once, with `setting(default, doc, rule...)`: its default, its one-line
meaning (docs/configuration.md's table is made from it: `reference_table`) and the rule its
value keeps (`choices`, the owner's vocabulary; `bound`; `at_most`).
"""
from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import field

from hpcnft.common.errors import ConfigError
from hpcnft.common.recipe_files import read_recipe

BOUNDS = ("> 0", ">= 0", "[0, 1]")


# on_resume: whether a resume may change a key from its checkpoint's config. "fixed": refused (what
# is scored or trained, how); "free": allowed (run length, where to write, how to wait, how to
# lay the job out: the results do not depend on it); "warn": allowed with a warning (where and how
# patiently a remote term asks, not what it scores)
ON_RESUME = ("fixed", "free", "warn")


def setting(default, doc: str, *, choices: typing.Iterable[str] = (), bound: str | tuple[str, ...] = "",
            at_most: float | None = None, infinite: bool = False, on_resume: str = "fixed"):
    """A config key: `default`; `doc`, its meaning in one line (markdown); the value one of
    `choices`, within `bound` ("> 0", ">= 0" or "[0, 1]", or several, checked in that order;
    then finite unless `infinite`) and at most `at_most`; whether a resume may change it
    (`on_resume`, one of ON_RESUME)."""
    bounds = (bound,) if isinstance(bound, str) else tuple(bound)
    bounds = tuple(b for b in bounds if b)
    if any(b not in BOUNDS for b in bounds):
        raise ValueError(f"bound {bound!r} is not within {BOUNDS}")
    if on_resume not in ON_RESUME:
        raise ValueError(f"on_resume {on_resume!r} is not one of {ON_RESUME}")
    meta = {"doc": doc, "choices": tuple(choices), "bounds": bounds, "at_most": at_most, "infinite": infinite,
            "on_resume": on_resume}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def section(cls):
    """A table of settings of the root (`[optim]`): the section class, with its defaults."""
    return field(default_factory=cls)


def fields_of(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _type_of(cls, name: str):
    return typing.get_type_hints(cls)[name]


def _coerce(key: str, value, typ):
    """Check `value` against the annotated type; ints are accepted where floats are expected."""
    origin = typing.get_origin(typ)
    if dataclasses.is_dataclass(typ):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table of settings, got {value!r}")
        item = typ()
        _apply(item, value, key + ".")
        return item
    if origin is list:
        (item,) = typing.get_args(typ)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(key, v, item) for v in value]
    if typ is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if typ is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {typ}")


def _apply(obj, data: dict, prefix: str = "") -> None:
    fields = fields_of(type(obj))
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in fields:
            raise ConfigError(f"unknown config key {key!r}" + _suggest(name, fields))
        current = getattr(obj, name)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: is a table of settings, not a value")
            _apply(current, value, key + ".")
        else:
            setattr(obj, name, _coerce(key, value, _type_of(type(obj), name)))


def _suggest(name: str, fields) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(fields), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def parse_set(item: str) -> tuple[str, object]:
    """`a.b=value` -> ("a.b", parsed value); the value is a TOML literal, or a bare string."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key, value


def _nest(key: str, value) -> dict:
    out: dict = {}
    cur = out
    parts = key.split(".")
    for p in parts[:-1]:
        cur = cur.setdefault(p, {})
    cur[parts[-1]] = value
    return out


def load(root_cls, recipe: str, overrides: list[str] | None = None, *, steps: int | None = None,
         run_dir: str | None = None):
    """A `root_cls` from a recipe, then the `--set` overrides, `--steps` and `--run-dir`; checked."""
    from hpcnft.common.validation import check

    cfg = root_cls()
    _, table = read_recipe(recipe)
    _apply(cfg, table)
    for item in overrides or []:
        key, value = parse_set(item)
        _apply(cfg, _nest(key, value))
    if steps is not None:
        _apply(cfg, {"steps": steps})
    if run_dir is not None:
        cfg.run_dir = run_dir
    check(cfg)
    return cfg


def from_dict(root_cls, data: dict):
    """A `root_cls` from a dict (a run file's or a checkpoint's config); checked."""
    from hpcnft.common.validation import check

    cfg = root_cls()
    _apply(cfg, data)
    check(cfg)
    return cfg


# -- the reference: every key, its value and its meaning ---------------------------------------
def documented_keys(cls, prefix: str = ""):
    """(key, field, class) of every setting under `cls`, in declaration order; a list of tables
    (reward.terms) gives its own row and one per key of an entry (reward.terms[].kind)."""
    for f in dataclasses.fields(cls):
        typ = _type_of(cls, f.name)
        if dataclasses.is_dataclass(typ):
            yield from documented_keys(typ, f"{prefix}{f.name}.")
            continue
        yield prefix + f.name, f, cls
        if typing.get_origin(typ) is list and dataclasses.is_dataclass(typing.get_args(typ)[0]):
            yield from documented_keys(typing.get_args(typ)[0], f"{prefix}{f.name}[].")


def keys_on_resume(cls, how: str) -> set[str]:
    """The keys under `cls` declared with on_resume=`how` (a key of a list's entries as
    reward.terms[].url)."""
    return {key for key, f, _ in documented_keys(cls) if f.metadata.get("on_resume", "fixed") == how}


def _literal(value) -> str:
    """A value as TOML writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    if dataclasses.is_dataclass(value):
        return "{" + ", ".join(f"{k} = {_literal(v)}" for k, v in vars(value).items()) + "}"
    return repr(value)


def allowed(f: dataclasses.Field) -> str:
    """A key's rule in words: its choices, its bound, its upper limit."""
    m = f.metadata
    parts = [", ".join(f"`{c}`" for c in m.get("choices", ()))]
    bounds = m.get("bounds", ())
    if bounds:
        finite = isinstance(f.default, float) and not m.get("infinite")
        bound = bounds[-1]  # the narrowest
        parts.append(("within " if bound.startswith("[") else "") + bound + (", finite" if finite else ""))
    if m.get("at_most") is not None:
        parts.append(f"<= {m['at_most']:g}")
    resume = m.get("on_resume", "fixed")
    if resume != "fixed":
        parts.append("a resume may change it" + (" (with a warning)" if resume == "warn" else ""))
    return "; ".join(p for p in parts if p)


def reference_table(cfg, value_header: str = "value") -> str:
    """The markdown table of every key of `cfg`: the key, its value in `cfg` as TOML writes it
    (for a key of a list's entries, the entry's default), what it may be, its meaning."""
    lines = [f"| key | {value_header} | allowed | meaning |", "|---|---|---|---|"]
    for key, f, cls in documented_keys(type(cfg)):
        doc = f.metadata.get("doc", "")
        if not doc or "|" in doc or "\n" in doc:
            raise ValueError(f"config key {key}: its documentation must be one line without '|' (declare it "
                             "with setting())")
        if "[]." in key:
            value = getattr(cls(), f.name)
        else:
            value = cfg
            for part in key.split("."):
                value = getattr(value, part)
        lines.append(f"| `{key}` | `{_literal(value)}` | {allowed(f)} | {doc} |")
    return "\n".join(lines) + "\n"


# -- common's own section ------------------------------------------------------------------
@dataclasses.dataclass
class DeterminismConfig:
    """`[determinism]`: hpcnft.common.determinism's mode (which imports torch, so it is declared here)."""
    enabled: bool = setting(True, "deterministic mode: deterministic algorithms, fixed seeds, no timing-chosen "
                                  "kernels (turns those perf levers off)")
    cpu_threads: int = setting(1, "CPU threads per rank, fixed (CPU conv reductions depend on the thread count)",
                               bound="> 0")
    layout_invariant: bool = setting(
        False, "results that do not depend on the number of train ranks: a step's samples in "
        "`determinism.virtual_shards` fixed shards, each sampled in its own batches and trained at `train.micro_batch`, "
        "the shards' gradients gathered and summed in a fixed order (LoRA; docs/determinism.md)")
    virtual_shards: int = setting(8, "`determinism.layout_invariant`: the fixed shards of a step's samples; the number "
                                     "of train ranks must divide it", bound="> 0")
