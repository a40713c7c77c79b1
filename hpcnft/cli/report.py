"""Tools around run files: `hpcnft compare`, `show`, `plot`, `watch` and `export-metrics`.

RUN is a run directory or its run.h5. None of these import torch, so they start fast; matplotlib
is imported only by `plot`. Unusable input (missing file, not a run file, unknown key) is one
line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time
from typing import Callable, Iterable, Mapping

import numpy as np

from hpcnft import __version__
from hpcnft.algo.registry import ALGORITHMS, spec_of, specs
from hpcnft.cli.plots import (DEFAULT_KEYS_TEXT, EPOCH, X_AXES, epoch_notes, parse_smooth, plot_curves,
                              plot_samples)
from hpcnft.common.errors import UsageError
from hpcnft.common.errors import first_line
from hpcnft.io import runfile, tbevents
from hpcnft.io.compare import (CompareError, Comparison, compare_metrics, dumps_standard, format_step,
                            format_value, metrics_from_standard, standard_document)
from hpcnft.io.live_run import RunFollower

WATCH_TIMED_OUT = 124  # the exit code of coreutils `timeout`


def add_arguments(name: str, parser: argparse.ArgumentParser) -> None:
    _ARGUMENTS[name](parser)


def main(name: str, args: argparse.Namespace) -> int:
    try:
        return _COMMANDS[name](args)
    except (runfile.RunFileError, CompareError) as e:
        raise UsageError(str(e)) from None


# == compare =============================================================================
def _compare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", metavar="A", help="run dir, run.h5 or standard .json (with --record: the run)")
    p.add_argument("b", metavar="B", help="run dir, run.h5 or standard .json (with --record: the .json to write)")
    p.add_argument("--keys", nargs="+", metavar="KEY",
                   help="metric keys to compare (default: every non-perf key in both)")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0: bitwise)")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: bitwise)")
    p.add_argument("--prefix", action="store_true",
                   help="runs of different lengths: compare only the steps up to the shorter one's last step")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.add_argument("--record", action="store_true", help="write run A's metrics as the standard B instead")
    p.epilog = "exit status: 0 same, 1 differ, 2 unusable input"


def _compare(args: argparse.Namespace) -> int:
    if args.record:
        if args.rtol or args.atol or args.json or args.prefix:
            raise UsageError("--record takes no --rtol, --atol, --prefix or --json")
        doc = record_standard(args.a, args.b, args.keys)
        rows = sum(len(r) for r in doc["metrics"].values())
        print(f"recorded {len(doc['metrics'])} keys ({rows} rows) of {args.a} to {args.b}")
        return 0
    result = compare_metrics(load_metrics(args.a), load_metrics(args.b), args.keys, args.rtol, args.atol,
                             prefix=args.prefix)
    if args.json:
        print(json.dumps({"a": args.a, "b": args.b, **result.to_dict()}, indent=2))
    else:
        print("\n".join(comparison_lines(result)))
    return 0 if result.same else 1


def load_metrics(path: str) -> dict[str, np.ndarray]:
    """The metric series of a run (dir or .h5) or of a recorded standard (.json)."""
    if not path.endswith(".json"):
        return runfile.read_run(path).metrics
    if os.path.exists(path) and not os.path.isfile(path):
        raise UsageError(f"{path}: not a regular file")  # a FIFO would block the reader
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such standard file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else first_line(e)
        raise UsageError(f"{path}: not a JSON standard ({reason})") from None
    try:
        return metrics_from_standard(doc)
    except CompareError as e:
        raise UsageError(f"{path}: {e}") from None


def comparison_lines(result: Comparison) -> list[str]:
    """One line per diverging key, then the verdict."""
    lines = []
    for d in result.divergences:
        ulps = "n/a" if d.ulps is None else str(d.ulps)
        line = (f"{d.key}: first differs at step {format_step(d.step)}: "
                f"A={format_value(d.a)} B={format_value(d.b)} ulps={ulps}")
        lines.append(line if d.reason == "values differ" else f"{line} ({d.reason})")
    return lines + [result.verdict]


def record_standard(run_path: str, standard_path: str, keys: Iterable[str] | None = None) -> dict:
    """Write the run's metrics (default: every non-perf key) as a standard; returns the document."""
    run = runfile.read_run(run_path)
    if keys is None:
        keys = [k for k in run.metrics if not runfile.is_perf_key(k)]
    missing = sorted(set(keys) - set(run.metrics))
    if missing:
        raise UsageError(f"{run.path}: no metric {missing[0]!r}")
    meta = {"commit": source_commit(), "source": run.path, "config": run.config,
            "hpcnft_version": run.attrs.get("hpcnft_version", __version__)}
    doc = standard_document({k: run.metrics[k] for k in keys}, meta)
    _write_atomically(standard_path, dumps_standard(doc))
    return doc


def source_commit() -> str:
    """The git commit of the hpcnft source tree ($GITHUB_SHA in CI), or "local"."""
    if os.environ.get("GITHUB_SHA"):
        return os.environ["GITHUB_SHA"]
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                           capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "local"
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else "local"


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        raise UsageError(f"{path}: cannot write ({e.strerror or e})") from None


# == show ================================================================================
def _show_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN", help="run dir or run.h5")


def _show(args: argparse.Namespace) -> int:
    print("\n".join(summary_lines(runfile.read_run(args.run))))
    return 0


def summary_lines(run: runfile.RunData) -> list[str]:
    a = run.attrs
    lines = [f"run {run.path}  (schema {a.get('schema')}, hpcnft {a.get('hpcnft_version')}, "
             f"created {a.get('created')}" + (f", run id {a['run_id']})" if a.get("run_id") else ")"),
             "config", *_packed(_flatten(run.config)),
             "topology", *_packed(f"{k}={_attr_text(v)}" for k, v in sorted(run.topology.items())),
             f"attempts ({len(run.attempts)})"]
    lines += [f"  #{att['n']}  " + "  ".join(f"{k}={_attr_text(v)}" for k, v in att.items() if k != "n")
              for att in run.attempts]
    lines.append(f"events ({len(run.events)})")
    lines += [f"  step {e['step']:>6}  {_clock(e['time'])}  {e['kind']:<10} {e['text']}" for e in run.events]
    return lines + [eval_policy_line(run.config), *watch_lines(run)] + _metric_table(run.metrics)


def watch_lines(run: runfile.RunData) -> list[str]:
    """The guard's state and the best checkpoint ([watch], checkpoint.keep_best), from the
    config and the events: what a user checks for reward hacking first."""
    config = run.config if isinstance(run.config, Mapping) else {}
    watch = config.get("watch") if isinstance(config.get("watch"), Mapping) else {}
    keep = config.get("checkpoint", {}).get("keep_best") if isinstance(config.get("checkpoint"), Mapping) else ""
    lines = []
    if watch.get("guard_metric"):
        fired = [e for e in run.events if e["kind"] == "guard"]
        state = (f"fired {len(fired)} time(s), last at step {fired[-1]['step']}: {fired[-1]['text']}" if fired
                 else "quiet")
        lines.append(f"guard on {watch['guard_metric']} (drop {watch.get('guard_drop')}, "
                     f"{watch.get('guard_action')}): {state}")
    if keep:
        best = [e for e in run.events if e["kind"] == "best"]
        lines.append(best[-1]["text"] + " (`hpcnft export --checkpoint best`)" if best
                     else f"best checkpoint by {keep}: none yet")
    return lines


_EVAL_POLICIES = {"old": "pi_old, the EMA of theta the rollouts sample with",
                  "ema": "the evaluation EMA of theta (eval.ema_decay), as in the official recipe"}


def eval_policy_line(config) -> str:
    """Which weights the eval/* metrics are of: the run config's eval.policy, which is also
    `hpcnft export`'s default --policy. Runs from before the key evaluated pi_old."""
    section = config.get("eval") if isinstance(config, Mapping) else None
    policy = section.get("policy") if isinstance(section, Mapping) else None
    source = "eval.policy" if policy is not None else "the config predates eval.policy"
    policy = "old" if policy is None else str(policy)
    algo = config.get("algo") if isinstance(config, Mapping) else None
    name = algo.get("name") if isinstance(algo, Mapping) else None
    what = _EVAL_POLICIES.get(policy, "unknown")
    if policy == "old" and name in ALGORITHMS and spec_of(name).old_policy_is:
        what = spec_of(name).old_policy_is  # an algorithm that sets pi_old its own way
    return f"eval metrics (eval/*) are of the {policy} policy: {what} ({source}; `hpcnft export` exports it by default)"


def _metric_table(metrics: Mapping[str, np.ndarray]) -> list[str]:
    """rows, last value, min and max (NaN aside, counted in its own column) of each metric."""
    with_rows = [k for k in _schema_order(metrics) if len(metrics[k])]
    width = max([len(k) for k in with_rows] + [6])
    lines = [f"metrics ({len(with_rows)} with rows)",
             f"  {'key':<{width}} {'rows':>6} {'last':>12} {'min':>12} {'max':>12} {'NaNs':>5}"]
    for key in with_rows:
        values = metrics[key][:, 1]
        numbers = values[~np.isnan(values)]
        lo, hi = (numbers.min(), numbers.max()) if numbers.size else (math.nan, math.nan)
        lines.append(f"  {key:<{width}} {len(values):>6} {values[-1]:>12.6g} {lo:>12.6g} {hi:>12.6g} "
                     f"{len(values) - len(numbers):>5}")
    empty = [k for k in _schema_order(metrics) if not len(metrics[k])]
    return lines + ([f"no rows ({len(empty)})", *_packed(empty)] if empty else [])


def _attr_text(v) -> str:
    return "-" if v == "" else str(v)


def _flatten(tree, prefix: str = "") -> list[str]:
    """Dotted key=value items of a nested config."""
    if not isinstance(tree, Mapping):
        return [f"{prefix.rstrip('.') or 'config'}={json.dumps(tree)}"]
    items = []
    for k, v in tree.items():
        items += _flatten(v, f"{prefix}{k}.") if isinstance(v, Mapping) else [f"{prefix}{k}={json.dumps(v)}"]
    return items


def _packed(items: Iterable[str], width: int = 100) -> list[str]:
    """Items two spaces apart, as many per indented line as fit in `width`."""
    lines: list[str] = []
    for item in items:
        if lines and len(lines[-1]) + 2 + len(item) <= width:
            lines[-1] += "  " + item
        else:
            lines.append("  " + item)
    return lines


def _clock(t: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    except (ValueError, OverflowError, OSError):  # a damaged time stamp (NaN, out of range)
        return f"time={t!r}"


def _schema_order(keys: Iterable[str]) -> list[str]:
    """Keys in the run file's order (rollout, train: the algorithms' own then the shared, ema, eval,
    perf), unknown keys last."""
    order = [*runfile.ROLLOUT_KEYS, *(k for spec in specs() for k in spec.metric_keys),
             *(k for k in runfile.ALL_KEYS if k not in runfile.ROLLOUT_KEYS)]
    rank = {k: i for i, k in enumerate(order)}
    return sorted(keys, key=lambda k: (rank.get(k, len(rank)), k))


# == plot ================================================================================
def _plot_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN", help="run dirs or run.h5 files, overlaid")
    p.add_argument("-o", "--output", required=True, metavar="PNG", help="image to write")
    p.add_argument("--keys", nargs="+", metavar="KEY",
                   help=f"one panel per key (default: those of {DEFAULT_KEYS_TEXT} with rows)")
    p.add_argument("--samples", action="store_true", help="show the run's rollout image grids (samples/step_*.png)")
    p.add_argument("--smooth", metavar="N|epoch",
                   help="draw the rolling mean over N steps, or (epoch) the mean per pass over the training "
                        "prompts (a run's prompt file and rollout.prompts_per_step), the raw values faint behind; "
                        "a series no finished pass holds a value of is drawn raw, with a line saying so")
    p.add_argument("--x", dest="x_axis", choices=X_AXES, default="step",
                   help="the x axis: step (default), or time: seconds of training, each run's cumulative "
                        "perf/iteration_s (evaluations and checkpoints left out), to compare runs per second")


def _plot(args: argparse.Namespace) -> int:
    if args.samples:
        if len(args.runs) != 1 or args.keys or args.smooth or args.x_axis != "step":
            raise UsageError("--samples takes exactly one RUN and no --keys, --smooth or --x")
        shown = plot_samples(args.runs[0], args.output)
        print(f"wrote {args.output}: {shown} sample grids")
        return 0
    smooth = parse_smooth(args.smooth)
    runs = [runfile.read_run(p) for p in args.runs]
    keys = plot_curves(runs, args.output, args.keys, smooth, args.x_axis)
    for note in epoch_notes(runs, keys) if smooth == EPOCH else []:
        print(f"hpcnft plot: {note}", file=sys.stderr)
    print(f"wrote {args.output}: {len(keys)} panels, {len(runs)} runs")
    return 0


# == watch ===============================================================================
def _watch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN", help="run dir or run.h5 (may not exist yet)")
    p.add_argument("--interval", type=float, default=2.0, metavar="S", help="seconds between polls (default 2)")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="give up after S seconds (default: never)")
    p.epilog = ("ends when the run logs a 'done' or 'error' event. exit status: 0 done, 1 error, "
                f"2 unusable input or no run file within the timeout, {WATCH_TIMED_OUT} timed out while running")


def _watch(args: argparse.Namespace) -> int:
    if args.interval <= 0 or (args.timeout is not None and args.timeout < 0):
        raise UsageError("--interval must be > 0 and --timeout >= 0")
    path = os.path.join(args.run, "run.h5") if os.path.isdir(args.run) else args.run
    return watch(path, args.interval, args.timeout)


def watch(path: str, interval: float = 2.0, timeout: float | None = None,
          emit: Callable[[str], None] = lambda line: print(line, flush=True)) -> int:
    """Follow the run file at `path` until the run ends; emits one line per step and per event."""
    deadline = None if timeout is None else time.monotonic() + timeout
    follower = RunFollower(path)
    try:
        while True:
            lines, end = follower.poll()
            for line in lines:
                emit(line)
            if end is not None:
                return 0 if end == "done" else 1
            if deadline is not None and time.monotonic() >= deadline:
                if not follower.seen_file:
                    raise UsageError(f"{path}: no run file after {timeout:g} s")
                at = "before any step" if follower.last_step is None else f"at step {format_step(follower.last_step)}"
                print(f"hpcnft watch: timed out after {timeout:g} s {at}", file=sys.stderr)
                return WATCH_TIMED_OUT
            time.sleep(interval if deadline is None else max(0.0, min(interval, deadline - time.monotonic())))
    finally:
        follower.close()


# == export-metrics ======================================================================
def _export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN", help="run dir or run.h5")
    p.add_argument("--csv", metavar="FILE", help="write a CSV: step, then one column per key")
    p.add_argument("--tensorboard", metavar="DIR", help="write a TensorBoard event file into DIR")
    p.add_argument("--keys", nargs="+", metavar="KEY", help="keys to export (default: all)")


def _export(args: argparse.Namespace) -> int:
    if not (args.csv or args.tensorboard):
        raise UsageError("give --csv FILE and/or --tensorboard DIR")
    metrics = runfile.read_run(args.run).metrics
    keys = _schema_order(set(args.keys or metrics))
    unknown = [k for k in keys if k not in metrics]
    if unknown:
        raise UsageError(f"{args.run}: no metric {unknown[0]!r}")
    chosen = {k: metrics[k] for k in keys}
    if args.csv:
        rows = write_csv(chosen, args.csv)
        print(f"wrote {args.csv}: {rows} steps, {len(keys)} keys")
    if args.tensorboard:
        try:
            path = tbevents.write_tensorboard(chosen, args.tensorboard)
        except tbevents.TensorBoardMissing as e:
            raise UsageError(str(e)) from None
        except OSError as e:
            raise UsageError(f"{args.tensorboard}: cannot write ({e.strerror or e})") from None
        print(f"wrote {path}")
    return 0


def write_csv(metrics: Mapping[str, np.ndarray], path: str) -> int:
    """Columns step, then one per key in the given order; blank where a key has no row at a
    step. Values are written exactly (shortest round-trip text; nan, inf). Returns the row count."""
    by_key = {k: dict(v.tolist()) for k, v in metrics.items()}
    steps = sorted(set().union(*by_key.values())) if by_key else []
    try:
        with open(path, "w", newline="", encoding="utf-8") as f:
            out = csv.writer(f)
            out.writerow(["step", *by_key])
            for step in steps:
                out.writerow([format_step(step), *(repr(col[step]) if step in col else "" for col in by_key.values())])
    except OSError as e:
        raise UsageError(f"{path}: cannot write ({e.strerror or e})") from None
    return len(steps)


_ARGUMENTS = {"compare": _compare_arguments, "show": _show_arguments, "plot": _plot_arguments,
              "watch": _watch_arguments, "export-metrics": _export_arguments}
_COMMANDS = {"compare": _compare, "show": _show, "plot": _plot, "watch": _watch, "export-metrics": _export}
