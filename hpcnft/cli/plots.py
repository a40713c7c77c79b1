"""The figures of `hpcnft plot`: metric curves of several runs, smoothed on request, and a run's
sample grids (matplotlib, imported only here and only when a figure is drawn).

Smoothing: `--smooth N` draws the rolling mean over the N steps ending at each row; `--smooth
epoch` the mean over each pass over the training prompts. A step's prompts cycle through the file,
so the reward of one step mostly says which prompts it drew; a pass holds every prompt once, and
its mean is what a trend is read from. A series no finished pass holds a value of (a run shorter
than one pass, an evaluation only in the unfinished last pass) is drawn raw, and `epoch_notes`
says so: a pass mean would leave its panel empty.

`--x time` draws every series against seconds of training instead of steps: the run's cumulative
perf/iteration_s (rollout, rewards and train step; evaluations, checkpoints and model loading left
out), each row at the end of its step's iteration and a pass mean at its mean step's time.
`--x both` draws each key twice, against steps (left) and seconds (right).

Without --keys the panels are the rollout reward, each evaluation mean beside it, and the
training curves (DiffusionNFT's or Flow-GRPO's loss, whichever the runs have)."""
from __future__ import annotations

import math
import os
import re

import numpy as np

from hpcnft.algo.registry import specs
from hpcnft.common.errors import UsageError
from hpcnft.io import runfile
from hpcnft.io.prompt_files import PromptFileError, read_prompt_file

REWARD_KEY = "rollout/reward/raw_mean"
# every algorithm's loss first, then the rest of their curves (a run has rows for its own alone)
TRAIN_PLOT_KEYS = list(dict.fromkeys([*(s.loss_key for s in specs()), *(k for s in specs() for k in s.plot_keys)]))
TIME_KEY = "perf/iteration_s"  # --x time: the seconds of each step's iteration, summed
X_AXES = ("step", "time", "both")
WATCH_PLOT_KEYS = ["eval/drift", "rollout/diversity"]  # [watch]'s signs of reward hacking, where measured
DEFAULT_KEYS_TEXT = (f"{REWARD_KEY}, each eval/*_mean beside it (the held-out judges too), "
                     f"{', '.join(WATCH_PLOT_KEYS)}, {', '.join(TRAIN_PLOT_KEYS)}")


def default_keys(has_rows: set[str]) -> list[str]:
    """The rollout reward, then each evaluation mean (eval/<term>_mean, PickScore first) so that
    the first sits beside it in the two-column grid, then [watch]'s drift and diversity, then the
    training curves; those with rows."""
    evals = sorted((k for k in has_rows if k.startswith("eval/") and k.endswith("_mean")),
                   key=lambda k: (k != "eval/pickscore_mean", k))
    return [k for k in [REWARD_KEY, *evals, *WATCH_PLOT_KEYS, *TRAIN_PLOT_KEYS] if k in has_rows]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


EPOCH = "epoch"  # --smooth epoch: the mean per pass over the training prompts


def rolling_mean(steps: np.ndarray, values: np.ndarray, window: int) -> np.ndarray:
    """At each row, the mean of the finite values of the rows whose step lies in the `window`
    steps ending at that row's step (fewer at the start or across gaps); NaN where none is
    finite, so that one skipped step does not blank its neighbours. Rows in step order."""
    means = np.full(len(values), np.nan)
    finite = np.isfinite(values)
    csum = np.concatenate([[0.0], np.cumsum(np.where(finite, values, 0.0))])
    ccount = np.concatenate([[0], np.cumsum(finite)])
    first = np.searchsorted(steps, steps - window, side="right")  # the first row with step > k - window
    last = np.arange(1, len(values) + 1)
    count = ccount[last] - ccount[first]
    has = count > 0
    means[has] = (csum[last] - csum[first])[has] / count[has]
    return means


def pass_index(steps: np.ndarray, prompts_per_step: int, num_prompts: int) -> np.ndarray:
    """The pass over the prompts each step belongs to: that of its first prompt, (k-1)*P // n
    (step 0, an evaluation before training, is pass -1 of its own)."""
    return ((steps.astype(np.int64) - 1) * prompts_per_step) // num_prompts


def pass_means(steps: np.ndarray, values: np.ndarray, prompts_per_step: int,
               num_prompts: int) -> tuple[np.ndarray, np.ndarray]:
    """(the mean step, the mean of the finite values) of each pass the rows reach to its last
    step; the run's unfinished last pass, which holds only some prompts, is left out."""
    if not len(steps):
        return np.zeros(0), np.zeros(0)
    passes = pass_index(steps, prompts_per_step, num_prompts)
    centres, means = [], []
    for p in np.unique(passes):
        last_step = ((p + 1) * num_prompts - 1) // prompts_per_step + 1
        if steps[-1] < last_step:
            continue
        mine = passes == p
        finite = values[mine][np.isfinite(values[mine])]
        centres.append(steps[mine].mean())
        means.append(finite.mean() if len(finite) else np.nan)
    return np.array(centres, dtype=float), np.array(means, dtype=float)


def first_pass_end(prompts_per_step: int, num_prompts: int) -> int:
    """The last step of the first pass over the prompts (the step holding prompt n - 1)."""
    return (num_prompts - 1) // prompts_per_step + 1


def epoch_series(rows: np.ndarray, run_last_step: float, prompts_per_step: int,
                 num_prompts: int) -> tuple[np.ndarray, np.ndarray, str | None]:
    """(x, y, why raw) of a series under --smooth epoch: its pass means, or its raw values with
    the reason when no pass mean would show them: a run shorter than one pass, or a series whose
    values all lie outside the finished passes (an evaluation only in the unfinished last one)."""
    steps, values = rows[:, 0], rows[:, 1]
    per_pass = num_prompts / prompts_per_step
    if run_last_step < first_pass_end(prompts_per_step, num_prompts):
        return steps, values, (f"the run ends at step {run_last_step:g}, before one pass over its "
                               f"{num_prompts} training prompts ({per_pass:g} steps of {prompts_per_step}) ends")
    x, y = pass_means(steps, values, prompts_per_step, num_prompts)
    if np.isfinite(values).any() and not np.isfinite(y).any():
        return steps, values, (f"no finished pass over its {num_prompts} training prompts ({per_pass:g} steps) "
                               "holds a value (the unfinished last pass is left out)")
    return x, y, None


def run_last_step(run: runfile.RunData) -> float:
    return max((float(v[-1, 0]) for v in run.metrics.values() if len(v)), default=0.0)


def epoch_notes(runs: list[runfile.RunData], keys: list[str]) -> list[str]:
    """One line per run (and key) that --smooth epoch draws raw, saying why."""
    notes = []
    for run, label in zip(runs, _run_labels([r.path for r in runs])):
        per_step, num_prompts = run_pass_length(run)
        last = run_last_step(run)
        why = {key: epoch_series(run.metrics[key], last, per_step, num_prompts)[2]
               for key in keys if len(run.metrics.get(key, ()))}
        raw = [key for key, reason in why.items() if reason]
        if raw and last < first_pass_end(per_step, num_prompts):
            notes.append(f"{label}: --smooth epoch draws the raw values: {why[raw[0]]}")
        else:
            notes += [f"{label}: --smooth epoch draws {key} raw: {why[key]}" for key in raw]
    return notes


def run_pass_length(run: runfile.RunData) -> tuple[int, int]:
    """(prompts per step, number of training prompts) of a run, from its config and prompt file."""
    try:
        per_step = int(run.config["rollout"]["prompts_per_step"])
        spec = run.config["data"]["train_prompts"]
    except (KeyError, TypeError, ValueError):
        raise UsageError(f"{run.path}: --smooth epoch needs rollout.prompts_per_step and "
                         "data.train_prompts in the run's config") from None
    try:
        return per_step, len(read_prompt_file(spec, "data.train_prompts"))
    except PromptFileError as e:
        raise UsageError(f"{run.path}: --smooth epoch counts the run's prompts: {e}") from None


def step_clock(run: runfile.RunData) -> tuple[np.ndarray, np.ndarray]:
    """(steps, seconds): the run's cumulative perf/iteration_s at the end of each step, 0 at step 0."""
    rows = run.metrics.get(TIME_KEY)
    if rows is None or not len(rows):
        raise UsageError(f"{run.path}: --x time needs the run's {TIME_KEY}, which has no rows")
    return np.concatenate([[0.0], rows[:, 0]]), np.concatenate([[0.0], np.cumsum(rows[:, 1])])


def parse_smooth(text: str | None) -> int | str | None:
    """--smooth's value: `epoch`, or a whole number of steps (1 or more)."""
    if text is None or text == EPOCH:
        return text
    try:
        window = int(text)
    except ValueError:
        window = 0
    if window < 1:
        raise UsageError(f"--smooth: {text!r} is neither a number of steps (1 or more) nor {EPOCH!r}")
    return window


def plot_curves(runs: list[runfile.RunData], out: str, keys: list[str] | None = None,
                smooth: int | str | None = None, x_axis: str = "step") -> list[str]:
    """One panel per key, the runs overlaid; returns the keys drawn."""
    plt = _pyplot()
    fig, keys = curves_figure(runs, keys, plt, smooth, x_axis)
    _save(fig, out, plt)
    return keys


def curves_figure(runs: list[runfile.RunData], keys: list[str] | None = None, plt=None,
                  smooth: int | str | None = None, x_axis: str = "step"):
    """(the figure, the keys drawn): a panel per key, the runs overlaid and told apart in the
    legend; smoothed, each run's raw values stay faint behind its smoothed curve. `x_axis`
    "time": against seconds of training (step_clock) instead of steps."""
    has_rows = {k for r in runs for k, v in r.metrics.items() if len(v)}
    if keys is None:
        keys = default_keys(has_rows)
        if not keys:
            raise UsageError(f"no rows for any of {DEFAULT_KEYS_TEXT}; choose --keys")
    for key in keys:
        if key not in has_rows:
            raise UsageError(f"no run has rows for {key!r}")
    plt = plt or _pyplot()
    panels = [(key, axis) for key in keys for axis in (("step", "time") if x_axis == "both" else (x_axis,))]
    ncols = min(2, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 3.5 * nrows), squeeze=False)
    labels = _run_labels([r.path for r in runs])
    pass_lengths = [run_pass_length(r) for r in runs] if smooth == EPOCH else None
    clocks = [step_clock(r) for r in runs] if x_axis != "step" else None
    raw_only = []  # per curve drawn under --smooth: whether it fell back to its raw values
    for ax, (key, axis) in zip(axes.flat, panels):
        drawn = np.zeros((0, 2))
        for i, (run, label) in enumerate(zip(runs, labels)):
            rows = run.metrics.get(key, np.zeros((0, 2)))
            # a line style per run, so that identical curves (same config) stay visible
            style = _LINE_STYLES[i % len(_LINE_STYLES)]
            x, y, label, why_raw = _series(rows, run, label, smooth, pass_lengths[i] if pass_lengths else None)
            if axis == "time":  # steps to seconds of training
                x, rows = np.interp(x, *clocks[i]), np.stack([np.interp(rows[:, 0], *clocks[i]), rows[:, 1]], axis=1)
            if smooth is None or why_raw:  # raw only: epoch_notes says why on the command line
                ax.plot(x, y, marker="." if len(rows) < 50 else None, linestyle=style, label=label)
            else:
                raw = ax.plot(rows[:, 0], rows[:, 1], linestyle=style, alpha=_RAW_ALPHA, linewidth=0.8)
                ax.plot(x, y, color=raw[0].get_color(), linestyle=style, label=label,
                        marker="o" if smooth == EPOCH else None, markersize=4)
            raw_only.append(bool(why_raw))
            drawn = np.concatenate([drawn, rows])
        ax.set_title(key)
        ax.set_ylabel(_y_label(key))
        if axis == "time":
            ax.set_xlabel(f"seconds of training (the sum of {TIME_KEY})")
        else:
            ax.set_xlabel("step")
            ax.xaxis.get_major_locator().set_params(integer=True)
        ax.ticklabel_format(axis="y", useOffset=False)  # values as they are, not "+6.08e1" offsets
        _single_value_limits(ax, drawn)
        ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if smooth is not None and all(raw_only):
        fig.suptitle("raw values: no finished pass over the training prompts to take a mean of")
    elif smooth is not None:
        fig.suptitle(f"{_smooth_name(smooth)} (faint: every value"
                     + ("; raw where no pass is finished)" if any(raw_only) else ")"))
    return fig, keys


def _series(rows: np.ndarray, run: runfile.RunData, label: str, smooth: int | str | None,
            pass_length: tuple[int, int] | None) -> tuple[np.ndarray, np.ndarray, str, str | None]:
    """(x, y, legend label, why raw) of one run's curve in a panel: the rows, their rolling mean,
    or their pass means (the rows themselves when no finished pass holds one, with the reason)."""
    steps, values = rows[:, 0], rows[:, 1]
    if smooth is None:
        return steps, values, label, None
    if smooth != EPOCH:
        return steps, rolling_mean(steps, values, smooth), label, None
    per_step, num_prompts = pass_length
    if not len(rows):
        return steps, values, label, None
    x, y, why_raw = epoch_series(rows, run_last_step(run), per_step, num_prompts)
    label = f"{label}, raw: no finished pass" if why_raw else f"{label}, pass of {num_prompts / per_step:g} steps"
    return x, y, label, why_raw


_LINE_STYLES = ["-", "--", ":", "-."]
_RAW_ALPHA = 0.25  # the raw values behind a smoothed curve


def _smooth_name(smooth: int | str) -> str:
    return "mean per pass over the training prompts" if smooth == EPOCH else f"rolling mean over {smooth} steps"
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
