"""Comparison of metric series (docs/run_file.md#inspecting-and-comparing-runs), shared by
`hpcnft compare` and the tests.

A series is a float64 array of (step, value) rows. Two series match when their steps are the
same and, at each step, the values are equal exactly, or within |a - b| <= atol + rtol * |b|
when a tolerance is asked for. NaN matches NaN only and +inf/-inf match themselves only,
tolerance or not.

Also the standard format: {"meta": {...}, "metrics": {key: [[step, value], ...]}} with NaN and
infinities written as the strings "NaN", "Infinity", "-Infinity" so that the file is strict
JSON; reading also accepts the bare NaN/Infinity tokens of Python's json module.

Pure: no file I/O, no torch.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np

Series = np.ndarray  # float64 (n, 2): rows of (step, value)

_NON_FINITE_TO_JSON = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}
_JSON_TO_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


class CompareError(ValueError):
    """Inputs that cannot be compared (missing key, malformed series): a one-line message."""


@dataclass(frozen=True)
class Divergence:
    """Where one key's series stop matching."""

    key: str
    step: float  # first step at which A and B disagree (value or presence)
    a: float | None  # A's value at `step`, None when A has no row there
    b: float | None
    ulps: int | None  # distance between a and b; None unless both are finite
    reason: str  # one line, e.g. "values differ" or "steps differ: A has [1, 2, 3], B has [1, 2]"

    def to_dict(self) -> dict:
        return {"key": self.key, "step": json_step(self.step), "a": json_number(self.a),
                "b": json_number(self.b), "ulps": self.ulps, "reason": self.reason}


@dataclass
class Comparison:
    keys: list[str]  # the keys compared, sorted
    steps: int  # distinct steps over all compared keys
    rtol: float = 0.0
    atol: float = 0.0
    divergences: list[Divergence] = field(default_factory=list)  # earliest step first
    last_a: float | None = None  # the last step of A's compared keys (None: no rows)
    last_b: float | None = None
    prefix: bool = False  # only the steps up to the shorter side's last step were compared

    @property
    def same(self) -> bool:
        return not self.divergences

    @property
    def lengths_differ(self) -> bool:
        return self.last_a != self.last_b

    @property
    def verdict(self) -> str:
        tolerance = f" (rtol={self.rtol:g}, atol={self.atol:g})" if self.rtol or self.atol else ""
        lengths = (f"A runs to step {_step_text(self.last_a)}, B to step {_step_text(self.last_b)}"
                   if self.lengths_differ else "")
        if self.prefix and self.lengths_differ:
            scope = f"{self.steps} common steps compared ({lengths})"
        else:
            scope = f"{self.steps} steps"
        if self.same:
            return f"same: {len(self.keys)} keys, {scope}{tolerance}"
        first = self.divergences[0]
        text = (f"differ: {len(self.divergences)} of {len(self.keys)} keys{tolerance}, "
                f"first at step {format_step(first.step)} ({first.key})")
        if self.prefix and self.lengths_differ:
            return f"{text}; {scope}"
        if self.lengths_differ:
            return f"{text}; the runs' lengths differ ({lengths}): --prefix compares their common steps"
        return text

    def to_dict(self) -> dict:
        return {"same": self.same, "verdict": self.verdict, "keys": self.keys, "steps": self.steps,
                "rtol": self.rtol, "atol": self.atol, "prefix": self.prefix,
                "last_step_a": None if self.last_a is None else json_step(self.last_a),
                "last_step_b": None if self.last_b is None else json_step(self.last_b),
                "divergences": [d.to_dict() for d in self.divergences]}


def _step_text(s: float | None) -> str:
    return "-" if s is None else format_step(s)


# -- single values ----------------------------------------------------------------------
def _ordered_int(x: float) -> int:
    """Map a float64 to an integer so that adjacent floats map to adjacent integers
    (sign-magnitude bits turned into a monotone scale; +0.0 and -0.0 both map to 0)."""
    bits = struct.unpack("<q", struct.pack("<d", x))[0]
    return bits if bits >= 0 else -(bits & 0x7FFF_FFFF_FFFF_FFFF)


def ulp_distance(a: float, b: float) -> int | None:
    """How many representable float64 values lie between a and b (1.0 vs the next float: 1);
    None when either is NaN or infinite."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return None
    return abs(_ordered_int(a) - _ordered_int(b))


def values_match(a: float, b: float, rtol: float = 0.0, atol: float = 0.0) -> bool:
    return bool(_match_mask(np.array([a], float), np.array([b], float), rtol, atol)[0])


def _match_mask(a: np.ndarray, b: np.ndarray, rtol: float, atol: float) -> np.ndarray:
    both_nan = np.isnan(a) & np.isnan(b)
    equal = a == b  # also decides infinities: inf == inf, inf != -inf, inf != finite
    if not (rtol or atol):
        return both_nan | equal
    finite = np.isfinite(a) & np.isfinite(b)
    with np.errstate(over="ignore", invalid="ignore"):
        close = finite & (np.abs(a - b) <= atol + rtol * np.abs(b))
    return both_nan | equal | close


# -- series -----------------------------------------------------------------------------
def compare_series(key: str, a: Series, b: Series, rtol: float = 0.0, atol: float = 0.0) -> Divergence | None:
    """The first place where series a and b disagree, or None when they match."""
    a, b = _as_series(key, a), _as_series(key, b)
    if a.shape != b.shape or not np.array_equal(a[:, 0], b[:, 0]):
        return _step_divergence(key, a, b)
    mismatched = np.flatnonzero(~_match_mask(a[:, 1], b[:, 1], rtol, atol))
    if mismatched.size == 0:
        return None
    row = int(mismatched[0])
    va, vb = float(a[row, 1]), float(b[row, 1])
    return Divergence(key, float(a[row, 0]), va, vb, ulp_distance(va, vb), "values differ")


def _step_divergence(key: str, a: Series, b: Series) -> Divergence:
    n = min(len(a), len(b))
    row = int(np.argmax(a[:n, 0] != b[:n, 0])) if n and np.any(a[:n, 0] != b[:n, 0]) else n
    step_a = float(a[row, 0]) if row < len(a) else None
    step_b = float(b[row, 0]) if row < len(b) else None
    # The earlier of the two steps is the first one that only one side has.
    step = min(s for s in (step_a, step_b) if s is not None)
    va = float(a[row, 1]) if step_a == step else None
    vb = float(b[row, 1]) if step_b == step else None
    ulps = ulp_distance(va, vb) if va is not None and vb is not None else None
    reason = f"steps differ: A has {_steps_excerpt(a[:, 0], row)}, B has {_steps_excerpt(b[:, 0], row)}"
    return Divergence(key, step, va, vb, ulps, reason)


def _steps_excerpt(steps: np.ndarray, row: int, width: int = 8) -> str:
    """The step list from shortly before `row` on, shortened for long runs."""
    start = max(0, row - 2) if len(steps) > width else 0
    shown = [format_step(s) for s in steps[start:start + width]]
    head = ["..."] if start else []
    tail = ["..."] if start + width < len(steps) else []
    text = "[" + ", ".join(head + shown + tail) + "]"
    return text if not (head or tail) else f"{text} ({len(steps)} rows)"


def _as_series(key: str, x) -> Series:
    arr = np.asarray(x, dtype=np.float64)
    if arr.size == 0:
        return arr.reshape(0, 2)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise CompareError(f"metric {key!r} has shape {arr.shape}, expected (n, 2) rows of (step, value)")
    return arr


# -- whole metric sets ------------------------------------------------------------------
def select_keys(a_keys: Iterable[str], b_keys: Iterable[str], requested: Iterable[str] | None = None) -> list[str]:
    """The requested keys (each must be in both), or by default every non-perf key in both."""
    a_keys, b_keys = set(a_keys), set(b_keys)
    if requested is None:
        keys = sorted(k for k in a_keys & b_keys if not k.startswith("perf/"))
        if not keys:
            raise CompareError("A and B have no metric key in common (perf/* excluded)")
        return keys
    for key in requested:
        missing = [side for side, have in (("A", a_keys), ("B", b_keys)) if key not in have]
        if missing:
            raise CompareError(f"key {key!r} is not in {' and '.join(missing)}")
    return sorted(set(requested))


def compare_metrics(a: Mapping[str, Series], b: Mapping[str, Series], keys: Iterable[str] | None = None,
                    rtol: float = 0.0, atol: float = 0.0, prefix: bool = False) -> Comparison:
    """Compare the chosen keys of two metric sets; raises CompareError on unusable input.

    `prefix`: compare only the steps up to the shorter side's last step (runs of one config and
    different lengths). The shorter side's rows at its own last step that the longer side lacks
    there are left out: an end-of-run evaluation the longer run had no reason to make."""
    for name, tol in (("rtol", rtol), ("atol", atol)):
        if not (tol >= 0 and math.isfinite(tol)):
            raise CompareError(f"{name} must be a finite number >= 0, got {tol!r}")
    chosen = select_keys(a, b, None if keys is None else list(keys))
    sa = {k: _as_series(k, a[k]) for k in chosen}
    sb = {k: _as_series(k, b[k]) for k in chosen}
    last_a, last_b = _last_step(sa), _last_step(sb)
    if prefix and last_a != last_b and last_a is not None and last_b is not None:
        sa, sb = _common_prefix(sa, sb, last_a, last_b)
    divergences = [d for k in chosen if (d := compare_series(k, sa[k], sb[k], rtol, atol)) is not None]
    divergences.sort(key=lambda d: (d.step, d.key))
    all_steps = [s[:, 0] for m in (sa, sb) for s in m.values()]
    steps = len(np.unique(np.concatenate(all_steps))) if all_steps else 0
    return Comparison(chosen, steps, float(rtol), float(atol), divergences, last_a, last_b, prefix)


def _last_step(metrics: Mapping[str, Series]) -> float | None:
    lasts = [float(np.max(s[:, 0])) for s in metrics.values() if len(s)]
    return max(lasts) if lasts else None


def _common_prefix(sa: dict[str, Series], sb: dict[str, Series], last_a: float,
                   last_b: float) -> tuple[dict[str, Series], dict[str, Series]]:
    end = min(last_a, last_b)
    short, long_ = (sa, sb) if last_a < last_b else (sb, sa)
    short_out, long_out = {}, {}
    for k in short:
        s, lg = short[k][short[k][:, 0] <= end], long_[k][long_[k][:, 0] <= end]
        extra = (s[:, 0] == end) & ~np.isin(s[:, 0], lg[:, 0])
        short_out[k], long_out[k] = s[~extra], lg
    return (short_out, long_out) if last_a < last_b else (long_out, short_out)


# -- standards (JSON) -------------------------------------------------------------------
def json_number(x: float | None):
    """A float as strict JSON: finite floats as they are, NaN and infinities as strings."""
    if x is None:
        return None
    x = float(x)
    if not math.isfinite(x):
        return _NON_FINITE_TO_JSON[repr(x)]
    return x


def json_step(s: float):
    """A step as JSON: an int when whole (steps are stored as float64)."""
    return int(s) if math.isfinite(s) and float(s).is_integer() else json_number(s)


def parse_json_number(v) -> float:
    if isinstance(v, str):
        if v not in _JSON_TO_NON_FINITE:
            raise CompareError(f"{v!r} is not a number (expected a number, 'NaN', 'Infinity' or '-Infinity')")
        return _JSON_TO_NON_FINITE[v]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        text = repr(v)
        raise CompareError(f"{text if len(text) <= 60 else text[:57] + '...'} is not a number")
    try:
        return float(v)
    except OverflowError:  # an integer beyond float64
        raise CompareError(f"{str(v)[:20]}... is out of range") from None


def standard_document(metrics: Mapping[str, Series], meta: Mapping[str, object]) -> dict:
    """The standard as a JSON-able dict, keys sorted."""
    rows = {key: [[json_step(s), json_number(v)] for s, v in _as_series(key, metrics[key])]
            for key in sorted(metrics)}
    return {"meta": dict(meta), "metrics": rows}


def dumps_standard(doc: Mapping) -> str:
    """The standard as JSON text: indent 2, keys sorted, one [step, value] row per line."""
    meta = json.dumps(doc["meta"], indent=2, sort_keys=True, allow_nan=False).replace("\n", "\n  ")
    series = []
    for key in sorted(doc["metrics"]):
        rows = [json.dumps(row, allow_nan=False) for row in doc["metrics"][key]]
        body = "[\n      " + ",\n      ".join(rows) + "\n    ]" if rows else "[]"
        series.append(f"    {json.dumps(key)}: {body}")
    metrics = "{\n" + ",\n".join(series) + "\n  }" if series else "{}"
    return f'{{\n  "meta": {meta},\n  "metrics": {metrics}\n}}\n'


def metrics_from_standard(doc) -> dict[str, Series]:
    """The metric series of a parsed standard document; raises CompareError when malformed."""
    if not isinstance(doc, dict) or not isinstance(doc.get("metrics"), dict):
        raise CompareError("not a standard: expected a JSON object with a 'metrics' object")
    out = {}
    for key, rows in doc["metrics"].items():
        if not isinstance(rows, list) or any(not isinstance(r, list) or len(r) != 2 for r in rows):
            raise CompareError(f"metric {key!r}: expected a list of [step, value] pairs")
        try:
            out[key] = np.array([[parse_json_number(s), parse_json_number(v)] for s, v in rows],
                                dtype=np.float64).reshape(-1, 2)
        except CompareError as e:
            raise CompareError(f"metric {key!r}: {e}") from None
    return out


def format_step(s: float) -> str:
    return str(int(s)) if float(s).is_integer() else repr(float(s))


def format_value(x: float | None) -> str:
    """Exact, shortest round-trip text of a value ('-' when absent)."""
    return "-" if x is None else repr(float(x))
