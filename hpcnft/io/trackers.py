"""Live trackers: rank 0 hands every metrics row and every sample grid to TensorBoard and/or
Weights & Biases as the run writes them to run.h5 (`logging.trackers`).

run.h5 is the record; a tracker is a view of it. At a start each tracker says up to which step
it already holds the run (`shown_through`); the job hands it run.h5's rows after that step up to
the resume step (`TrackerGroup.backfill`), then the new rows as they come. So a tracker continues
its curves across resumes without showing a step twice, fills in what a killed start lost, and
can be added to a run that is under way. A tracker that fails is dropped with one warning
instead of stopping the training (`TrackerGroup`).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
from typing import Callable, Mapping, Protocol

import numpy as np

from hpcnft.io.config import TRACKERS

TENSORBOARD_DIR = "tensorboard"  # RUN_DIR/tensorboard
# What each tracker holds, written when it closes cleanly: {"last_step": n} (and wandb's run id)
TENSORBOARD_STATE = "hpcnft-tensorboard.json"  # RUN_DIR/tensorboard/ (TensorBoard reads only *tfevents* files)
WANDB_STATE = "hpcnft-wandb.json"  # RUN_DIR/wandb/


def missing_package(name: str) -> str | None:
    """One line saying what to install when tracker `name`'s package is absent, else None."""
    module, extra = TRACKERS[name]  # the module it imports, the pip extra that installs it
    if importlib.util.find_spec(module) is None:
        return (f"logging.trackers: {name!r} needs the {module} package, which is not installed "
                f"(pip install 'hpcnft[{extra}]')")
    return None


class Tracker(Protocol):
    name: str
    where: str  # what the user opens, for the start's terminal line
    shown_through: int  # the last step of the run it already holds (-1: none)

    def log_row(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def log_image(self, step: int, tag: str, image: str | np.ndarray) -> None: ...

    def close(self) -> None: ...


def _read_state(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise OSError(f"{path}: unreadable ({e})") from None
    if not isinstance(state, dict) or not isinstance(state.get("last_step", -1), int):
        raise OSError(f"{path}: not a tracker state")
    return state


def _write_state(path: str, state: Mapping[str, object]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(dict(state), f)
    os.replace(tmp, path)


def animation_of(image: str | np.ndarray) -> str | None:
    """The GIF saved beside a grid's PNG (a video step's: run/output.py's save_grid), if any."""
    if isinstance(image, str) and image.endswith(".png") and os.path.exists(image[:-4] + ".gif"):
        return image[:-4] + ".gif"
    return None


def _gif_summary(tag: str, path: str):
    """A TensorBoard image summary holding a GIF file as it is (torch's add_video writes its videos
    so, encoded by moviepy; the GIF is written already)."""
    from PIL import Image
    from tensorboard.compat.proto.summary_pb2 import Summary

    with Image.open(path) as im:
        width, height = im.size
    with open(path, "rb") as f:
        data = f.read()
    return Summary(value=[Summary.Value(tag=tag, image=Summary.Image(height=height, width=width, colorspace=3,
                                                                     encoded_image_string=data))])


def _as_array(image: str | np.ndarray) -> np.ndarray:
    """An image file or an (H, W, 3) uint8 array -> the array."""
    if isinstance(image, np.ndarray):
        return image
    from PIL import Image

    with Image.open(image) as im:
        return np.asarray(im.convert("RGB"))


class TensorBoardTracker:
    """Event files in RUN_DIR/tensorboard, flushed at every row. A start writes TensorBoard's
    purge marker at the first step it logs (SummaryWriter's purge_step): readers then drop
    whatever earlier starts logged from that step on (rows of steps run again after a resume),
    so each step shows once.

    `kept_through`: the last step whose rows earlier starts wrote as run.h5 still holds them (the
    resume step, or one less where that step's rows were dropped). The log dir holds the run up to
    there if the last start that had TensorBoard on closed it cleanly at or after that step;
    otherwise (a new log dir, a killed start, TensorBoard off for some starts) the purge marker
    goes earlier and run.h5 fills in."""

    name = "tensorboard"

    def __init__(self, run_dir: str, kept_through: int):
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = os.path.join(run_dir, TENSORBOARD_DIR)
        self.state_path = os.path.join(self.logdir, TENSORBOARD_STATE)
        earlier = os.path.isdir(self.logdir) and any(".tfevents." in n for n in os.listdir(self.logdir))
        closed_at = _read_state(self.state_path).get("last_step", -1) if earlier else -1
        self.shown_through = self.last_logged = min(kept_through, closed_at)
        self._writer = SummaryWriter(self.logdir, purge_step=self.shown_through + 1, filename_suffix=".hpcnft")
        if os.path.exists(self.state_path):
            os.remove(self.state_path)  # until this start closes cleanly
        self.where = f"tensorboard --logdir {self.logdir}"

    def log_row(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, float(value), step)
        self._writer.flush()  # live: the row is on disk before the next step starts
        self.last_logged = max(self.last_logged, step)

    def log_image(self, step: int, tag: str, image: str | np.ndarray) -> None:
        gif = animation_of(image)
        if gif:  # a video step's grid: the GIF's bytes as the image, which TensorBoard's page plays
            self._writer._get_file_writer().add_summary(_gif_summary(tag, gif), step)  # as add_video does
        else:
            self._writer.add_image(tag, _as_array(image), step, dataformats="HWC")
        self._writer.flush()

    def close(self) -> None:
        writers = list((self._writer.all_writers or {}).values())
        try:
            self._writer.close()
        finally:
            # A writer whose thread failed (a full disk) raises in the flush that SummaryWriter's
            # close starts with, and its thread is never stopped: stop each one here, so that the
            # thread ends, and reports, while the tracker closes rather than during what follows.
            for file_writer in writers:
                try:
                    file_writer.close()
                except Exception:  # noqa: BLE001 - the flush's error is the one raised
                    pass
        _write_state(self.state_path, {"last_step": self.last_logged})


def wandb_mode(environ: Mapping[str, str]) -> str | None:
    """The mode to ask wandb for: None (wandb's own choice) when the user configured wandb
    through WANDB_MODE or WANDB_API_KEY, else "offline" (nothing leaves the machine)."""
    return None if environ.get("WANDB_MODE") or environ.get("WANDB_API_KEY") else "offline"


class WandbTracker:
    """A wandb run in RUN_DIR/wandb (offline unless the user configured wandb). Its id is kept in
    RUN_DIR/wandb/hpcnft-wandb.json, so a resumed run continues the same wandb run
    (resume="allow", same id), with the last step of a start that closed the run cleanly: the next
    start logs only later steps (wandb's step only grows). A start killed outright loses what
    wandb had not yet written (its service buffers); the file then still names the step of the last
    clean close, and the next start fills in from run.h5."""

    name = "wandb"

    def __init__(self, run_dir: str, config: Mapping[str, object], environ: Mapping[str, str] = os.environ):
        import wandb

        self._wandb = wandb
        self.state_path = os.path.join(run_dir, "wandb", WANDB_STATE)
        os.makedirs(os.path.dirname(self.state_path), mode=0o700, exist_ok=True)
        state = _read_state(self.state_path)
        self.run_id = state.get("id") or secrets.token_hex(8)
        if not (isinstance(self.run_id, str) and re.fullmatch(r"[0-9a-z]{1,64}", self.run_id)):
            raise OSError(f"{self.state_path}: not a wandb run id: {self.run_id!r}")
        self.shown_through = int(state.get("last_step", -1))
        self.last_logged = self.shown_through
        _write_state(self.state_path, {"id": self.run_id, "last_step": self.shown_through})  # the id, first
        self.run = wandb.init(
            dir=run_dir, id=self.run_id, resume="allow", mode=wandb_mode(environ),
            project=environ.get("WANDB_PROJECT") or "hpcnft",
            name=os.path.basename(os.path.abspath(run_dir)), config=dict(config),
            # hpcnft owns the terminal: no console capture, no banner
            settings=wandb.Settings(console="off", silent=True))
        self.where = f"wandb run {self.run_id} ({self.run.settings.mode}) in {os.path.dirname(self.state_path)}"

    def log_row(self, step: int, metrics: Mapping[str, float]) -> None:
        if step <= self.shown_through:
            return
        # not committed: the step's sample grid joins the row; wandb commits it at the next step
        self.run.log({k: float(v) for k, v in metrics.items()}, step=step)
        self.last_logged = max(self.last_logged, step)

    def log_image(self, step: int, tag: str, image: str | np.ndarray) -> None:
        if step <= self.shown_through:
            return
        gif = animation_of(image)  # a video step's grid: the animation, which wandb plays
        media = self._wandb.Video(gif, format="gif") if gif else self._wandb.Image(_as_array(image))
        self.run.log({tag: media}, step=step)

    def close(self) -> None:
        self.run.finish()
        # finish() can return before wandb's service has written the run's file (it buffers): the
        # service's shutdown waits for it, so the file is whole when the job goes on or exits.
        self._wandb.teardown()
        _write_state(self.state_path, {"id": self.run_id, "last_step": self.last_logged})


def open_tracker(name: str, run_dir: str, kept_through: int, config: Mapping[str, object]) -> Tracker:
    """Tracker `name` for a start after step `kept_through` (see TensorBoardTracker)."""
    if name == "tensorboard":
        return TensorBoardTracker(run_dir, kept_through)
    if name == "wandb":
        return WandbTracker(run_dir, config)
    raise ValueError(f"unknown tracker {name!r}")


class TrackerGroup:
    """The run's trackers behind one call each. A tracker that raises (disk full, network, a bug
    of its library) is warned about once and left out from then on: the run goes on, run.h5
    holds every row."""

    def __init__(self, trackers: list[Tracker], warn: Callable[[str], None]):
        self.trackers, self.warn = list(trackers), warn

    @classmethod
    def open(cls, names: list[str], run_dir: str, kept_through: int, config: Mapping[str, object],
             warn: Callable[[str], None], opener=open_tracker) -> "TrackerGroup":
        group = cls([], warn)
        for name in names:
            try:
                group.trackers.append(opener(name, run_dir, kept_through, config))
            except Exception as e:  # noqa: BLE001 - a tracker never stops the run
                group._failed(name, f"cannot start ({_reason(e)})")
        return group

    def _each(self, what: str, call: Callable[[Tracker], None], only: Tracker | None = None) -> None:
        for tracker in [only] if only is not None else list(self.trackers):
            if tracker not in self.trackers:  # failed already
                continue
            try:
                call(tracker)
            except Exception as e:  # noqa: BLE001 - a tracker never stops the run
                self.trackers.remove(tracker)
                self._failed(tracker.name, f"failed {what} ({_reason(e)})")
                try:
                    tracker.close()
                except Exception:  # noqa: BLE001 - already reported
                    pass

    def _failed(self, name: str, what: str) -> None:
        self.warn(f"tracker {name} {what}; it is off for the rest of this start (run.h5 keeps every row)")

    def backfill(self, through: int, rows_between: Callable[[int, int], Mapping[int, Mapping[str, float]]],
                 grid_path: Callable[[int], str | None]) -> None:
        """Give each tracker what it lacks of steps <= `through`: run.h5's rows after its
        `shown_through` (`rows_between(after, through)`) and the sample grids saved for them."""
        for tracker in list(self.trackers):
            if tracker.shown_through >= through:
                continue
            for step, row in rows_between(tracker.shown_through, through).items():
                self._each(f"at step {step}", lambda t: t.log_row(step, row), only=tracker)
                grid = grid_path(step)
                if grid:
                    self._each(f"at step {step}", lambda t: t.log_image(step, "samples", grid), only=tracker)

    def log_row(self, step: int, metrics: Mapping[str, float]) -> None:
        self._each(f"at step {step}", lambda t: t.log_row(step, metrics))

    def log_image(self, step: int, tag: str, image: str | np.ndarray) -> None:
        self._each(f"at step {step}", lambda t: t.log_image(step, tag, image))

    def close(self) -> None:
        self._each("when closing", lambda t: t.close())
        self.trackers.clear()


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
