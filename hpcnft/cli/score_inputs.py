"""What `hpcnft score` scores: image files (PNG, JPEG or whatever else Pillow reads, 16-bit and
transparent ones as `to_rgb` says) with the prompt of each, and the cells of a run's sample grids (RUN_DIR/samples/step_*.png) with the
prompt each cell was generated from, found from the run's config and topology in its run.h5.
A file of several frames (an animated GIF, a video run's grid RUN_DIR/samples/step_*.gif) is scored
frame by frame, as a reward rank scores a video's frames, each frame an item of its video.
Every problem is a UsageError of one line naming the file."""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import numpy as np

from hpcnft.common.errors import UsageError, first_line

GRID_NAME = re.compile(r"step_(\d+)\.(?:png|gif)")
MAX_PIXELS = 8192 * 8192  # a side of the reward service's MAX_SIDE, squared


@dataclass
class Scored:
    """One image to score: its label (the path, `#k` for a grid's cell k), prompt and pixels."""
    label: str
    prompt: str | None
    image: np.ndarray  # uint8 [H, W, 3]
    video: str | None = None  # a frame's: the label of its video (its scores pooled under it)


def read_frames(path: str) -> list[np.ndarray]:
    """Every frame of an image file (one for a still), each uint8 RGB [H, W, 3]."""
    from PIL import Image, ImageSequence

    first = read_image(path)  # its checks and errors
    with Image.open(path) as im:
        if getattr(im, "n_frames", 1) == 1:
            return [first]
        return [to_rgb(frame.copy(), path) for frame in ImageSequence.Iterator(im)]


def as_frames(label: str, prompt: str | None, frames: list[np.ndarray]) -> list[Scored]:
    """A still as itself; a video's frames as `label@f`, each an item of video `label`."""
    if len(frames) == 1:
        return [Scored(label, prompt, frames[0])]
    return [Scored(f"{label}@{f}", prompt, frame, label) for f, frame in enumerate(frames)]


def read_image(path: str) -> np.ndarray:
    """The file's pixels as uint8 RGB [H, W, 3] (`to_rgb`)."""
    from PIL import Image, UnidentifiedImageError

    if os.path.isdir(path):
        raise UsageError(f"{path}: a directory, not an image file")
    if not os.path.exists(path):
        raise UsageError(f"{path}: no such file")
    try:
        with Image.open(path) as im:
            if im.width * im.height > MAX_PIXELS:
                raise UsageError(f"{path}: {im.width}x{im.height} pixels is more than hpcnft scores "
                                 f"({MAX_PIXELS} pixels)")
            im.load()  # decoded here: a truncated file fails now, as one line
            return to_rgb(im, path)
    except UsageError:
        raise
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise UsageError(f"{path}: not an image file Pillow can read ({first_line(e, type(e).__name__)})") from None


def to_rgb(im, path: str) -> np.ndarray:
    """A decoded image as uint8 RGB. 16-bit greyscale (Pillow's I;16, which convert("RGB") clips
    to white) keeps its high byte, as Pillow reads 16-bit colour PNGs; 32-bit integer and float
    pixels have no one 8-bit reading and are refused. Transparency (an alpha band, or a PNG's
    transparent colour) is composited onto white, as the terms' official preprocessing does
    (transformers' CLIP processor, PaddleOCR and RapidOCR), where convert("RGB") would drop it."""
    from PIL import Image

    if im.mode.startswith("I;16"):
        wide = np.asarray(im).astype(np.uint16)  # the file's byte order, as numbers
        grey = Image.fromarray((wide >> 8).astype(np.uint8), "L")
        clear = im.info.get("transparency")
        if isinstance(clear, int):  # a 16-bit transparent grey level
            grey.putalpha(Image.fromarray(np.where(wide == clear, 0, 255).astype(np.uint8), "L"))
        im = grey
    elif im.mode in ("I", "F"):
        kind = "32-bit integer" if im.mode == "I" else "floating-point"
        raise UsageError(f"{path}: {kind} pixels (Pillow mode {im.mode}); hpcnft scores 8- or 16-bit images")
    if "A" in im.getbands() or "transparency" in im.info:
        white = Image.new("RGBA", im.size, (255, 255, 255, 255))
        im = Image.alpha_composite(white, im.convert("RGBA"))
    return np.asarray(im.convert("RGB"), dtype=np.uint8)


def run_of_grid(path: str) -> str | None:
    """The run dir whose sample grid `path` is (RUN_DIR/samples/step_NNNNNN.png beside a run.h5), or None."""
    folder = os.path.dirname(os.path.abspath(path))
    run_dir = os.path.dirname(folder)
    if GRID_NAME.fullmatch(os.path.basename(path)) and os.path.basename(folder) == "samples" and \
            os.path.isfile(os.path.join(run_dir, "run.h5")):
        return run_dir
    return None


def grid_cells(path: str, run_dir: str) -> list[Scored]:
    """The images of a run's sample grid, each with the prompt it was generated from."""
    from hpcnft.algo.prompts import PromptFileError, train_stream
    from hpcnft.algo.root_config import ConfigError, config_from_dict
    from hpcnft.algo.sampler import grid_cells as cells_of, grid_sample_ids
    from hpcnft.io.runfile import RunFileError, read_run

    step = int(GRID_NAME.fullmatch(os.path.basename(path)).group(1))
    try:
        run = read_run(run_dir)
        cfg = config_from_dict(run.config)
        train_ranks = run.topology.get("train_ranks")
        ranks = len(json.loads(train_ranks) if isinstance(train_ranks, str) else train_ranks)
        stream = train_stream(cfg)
    except (RunFileError, ConfigError, PromptFileError) as e:
        raise UsageError(f"{path}: a sample grid of run {run_dir!r}, whose prompts cannot be found: {e}") from None
    except (TypeError, ValueError) as e:
        raise UsageError(f"{path}: the run file of {run_dir!r} names no train ranks ({e})") from None
    prompts = stream.for_step(step, cfg.rollout.prompts_per_step)
    g = cfg.rollout.samples_per_prompt
    ids = grid_sample_ids(cfg.samples_per_step, ranks, cfg.logging.sample_grid_images)
    cell_prompts = [prompts[i // g] for i in ids]
    try:  # [frames, cells, H, W, 3]
        cells = np.stack([cells_of(frame, cell_prompts, cfg.rollout.height, cfg.rollout.width)
                          for frame in read_frames(path)])
    except ValueError as e:
        raise UsageError(f"{path}: {e} (the grid run {run_dir!r} would write at step {step})") from None
    return [item for k, p in enumerate(cell_prompts) for item in as_frames(f"{path}#{k}", p, list(cells[:, k]))]


def read_prompts(prompt: str | None, prompts_file: str | None, n_files: int) -> list[str] | None:
    """The prompt of each of `n_files` plain image files: --prompt for all of them, or the lines
    of --prompts FILE (one for all, or one per file, in order); None where neither is given."""
    from hpcnft.io.prompt_files import PromptFileError, read_prompt_file

    if prompt is not None:
        if not prompt.strip():
            raise UsageError("--prompt: empty")
        return [prompt] * n_files
    if prompts_file is None:
        return None
    try:
        lines = read_prompt_file(prompts_file, "--prompts")
    except PromptFileError as e:
        raise UsageError(str(e)) from None
    if len(lines) == 1:
        return lines * n_files
    if len(lines) != n_files:
        raise UsageError(f"--prompts {prompts_file}: {len(lines)} prompts for {n_files} image files "
                         "(one prompt for all, or one per file in order)")
    return lines


def inputs(paths: list[str], prompt: str | None, prompts_file: str | None) -> list[Scored]:
    """Every image the paths name, in order, each with its prompt (a grid's cells with theirs)."""
    grids = {path: run_of_grid(path) for path in paths}
    files = [path for path in paths if grids[path] is None]
    prompts = read_prompts(prompt, prompts_file, len(files))
    if files and prompts is None:
        raise UsageError(f"no prompt for {files[0]}: give --prompt TEXT or --prompts FILE")
    next_prompt = iter(prompts or [])  # by position: a file named twice takes a prompt each time
    out: list[Scored] = []
    for path in paths:
        out += grid_cells(path, grids[path]) if grids[path] else as_frames(path, next(next_prompt), read_frames(path))
    return out
