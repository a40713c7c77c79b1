"""The figures of `hpcnft plot`: metric curves of several runs, and a run's sample grids
(matplotlib, imported only here and only when a figure is drawn)."""
from __future__ import annotations

import math
import os
import re

import numpy as np

from hpcnft.common.errors import UsageError
from hpcnft.io import runfile

DEFAULT_PLOT_KEYS = ["rollout/reward/raw_mean", "train/nft_loss", "train/grad_norm", "train/nft_pos_loss",
                     "eval/pickscore_mean"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(runs: list[runfile.RunData], out: str, keys: list[str] | None = None) -> list[str]:
    """One panel per key, the runs overlaid; returns the keys drawn."""
    plt = _pyplot()
    fig, keys = curves_figure(runs, keys, plt)
    _save(fig, out, plt)
    return keys


def curves_figure(runs: list[runfile.RunData], keys: list[str] | None = None, plt=None):
    """(the figure, the keys drawn): a panel per key, the runs overlaid and told apart in the legend."""
    has_rows = {k for r in runs for k, v in r.metrics.items() if len(v)}
    if keys is None:
        keys = [k for k in DEFAULT_PLOT_KEYS if k in has_rows]
        if not keys:
            raise UsageError(f"no rows for any of {', '.join(DEFAULT_PLOT_KEYS)}; choose --keys")
    for key in keys:
        if key not in has_rows:
            raise UsageError(f"no run has rows for {key!r}")
    plt = plt or _pyplot()
    ncols = min(2, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 3.5 * nrows), squeeze=False)
    labels = _run_labels([r.path for r in runs])
    for ax, key in zip(axes.flat, keys):
        drawn = np.zeros((0, 2))
        for i, (run, label) in enumerate(zip(runs, labels)):
            rows = run.metrics.get(key, np.zeros((0, 2)))
            # a line style per run, so that identical curves (same config) stay visible
            ax.plot(rows[:, 0], rows[:, 1], marker="." if len(rows) < 50 else None, label=label,
                    linestyle=_LINE_STYLES[i % len(_LINE_STYLES)])
            drawn = np.concatenate([drawn, rows])
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.set_ylabel(_y_label(key))
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.ticklabel_format(axis="y", useOffset=False)  # values as they are, not "+6.08e1" offsets
        _single_value_limits(ax, drawn)
        ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    return fig, keys


_LINE_STYLES = ["-", "--", ":", "-."]
_Y_UNITS = {"perf/images_per_s": "images/s", "perf/mfu_rollout": "MFU", "perf/mfu_train": "MFU"}


def _y_label(key: str) -> str:
    """The metric's own name, with its unit where it has one."""
    name = key.rsplit("/", 1)[-1]
    if key in _Y_UNITS:
        return f"{name} ({_Y_UNITS[key]})"
    return f"{name} (s)" if key.startswith("perf/") and key.endswith("_s") else name


def _single_value_limits(ax, rows: np.ndarray) -> None:
    """One step (or one value) spans no range: centre it with whole-step ticks and a margin."""
    finite = rows[np.isfinite(rows).all(axis=1)] if len(rows) else rows
    if not len(finite):
        return
    steps, values = np.unique(finite[:, 0]), finite[:, 1]
    if len(steps) == 1:
        ax.set_xlim(steps[0] - 1, steps[0] + 1)
        ax.set_xticks([steps[0]])
    if values.min() == values.max():
        v = float(values[0])
        pad = abs(v) * 0.05 or 1.0
        ax.set_ylim(v - pad, v + pad)


def _run_labels(paths: list[str]) -> list[str]:
    """Each run's shortest path suffix (its directory, then as many parents as it takes) that
    tells it apart from the others; the same run given twice is numbered."""
    dirs = [os.path.dirname(os.path.abspath(p)) if os.path.basename(p) == "run.h5" else os.path.abspath(p)
            for p in paths]
    parts = [d.strip(os.sep).split(os.sep) for d in dirs]
    labels = []
    for i, mine in enumerate(parts):
        others = [p for j, p in enumerate(parts) if p != mine]
        depth = 1
        while depth < len(mine) and any(p[-depth:] == mine[-depth:] for p in others):
            depth += 1
        labels.append(os.path.join(*mine[-depth:]) if mine and mine[0] else dirs[i])
    seen: dict[str, int] = {}
    numbered = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        numbered.append(f"{label} #{seen[label]}" if labels.count(label) > 1 else label)
    return numbered


def plot_samples(run: str, out: str, max_images: int = 16) -> int:
    """The rollout grids in RUN_DIR/samples, evenly spread over the run; returns how many."""
    run_dir = run if os.path.isdir(run) else os.path.dirname(run)
    found = sample_grids(os.path.join(run_dir, "samples"))
    if not found:
        raise UsageError(f"{run_dir}: no sample grids (samples/step_*.png)")
    shown = found if len(found) <= max_images else [
        found[round(i * (len(found) - 1) / (max_images - 1))] for i in range(max_images)]
    plt = _pyplot()
    ncols = min(4, len(shown))
    nrows = math.ceil(len(shown) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4 * ncols, 4 * nrows), squeeze=False)
    for ax, (step, path) in zip(axes.flat, shown):
        try:
            ax.imshow(plt.imread(path))
        except (OSError, ValueError, SyntaxError) as e:
            raise UsageError(f"{path}: not a readable PNG ({e})") from None
        ax.set_title(f"step {step}")
    for ax in axes.flat:
        ax.axis("off")
    if len(shown) < len(found):
        fig.suptitle(f"{len(shown)} of {len(found)} sample grids, evenly spaced")
    _save(fig, out, plt)
    return len(shown)


def sample_grids(samples_dir: str) -> list[tuple[int, str]]:
    """(step, path) of each samples/step_<k>.png, by step."""
    if not os.path.isdir(samples_dir):
        return []
    found = [(int(m.group(1)), os.path.join(samples_dir, n))
             for n in os.listdir(samples_dir) if (m := re.fullmatch(r"step_(\d+)\.png", n))]
    return sorted(found)


def _save(fig, out: str, plt) -> None:
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=100)
    except (OSError, ValueError) as e:
        raise UsageError(f"{out}: cannot write image ({e})") from None
    finally:
        plt.close(fig)
