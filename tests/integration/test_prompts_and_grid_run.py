"""A run with prompts longer than the text encoders take says so once, and its sample grid holds
the configured number of rollout images from every train rank, a column per prompt. Its eval
prompts come from one category of a DrawBench-shaped CSV."""
from __future__ import annotations

import os

import numpy as np
import pytest
from PIL import Image

from jobs import hpcnft
from hpcnft.algo.prompts import read_prompt_file
from hpcnft.io.runfile import read_run

pytestmark = pytest.mark.slow


def test_long_prompts_warn_once_and_the_grid_shows_both_train_ranks(tmp_path):
    prompts = read_prompt_file("builtin:tiny_train_prompts.txt", "p")
    long_line = " ".join(["a red cat sitting on a blue chair"] * 150)  # ~5,000 characters
    prompts = [prompts[0], long_line, prompts[1], prompts[2] + " with a small dog" * 3] + prompts[3:]
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(prompts) + "\n")
    # the built-in eval prompts as a DrawBench copy: the first 5 in category "Colors", quoted
    eval_prompts = read_prompt_file("builtin:tiny_eval_prompts.txt", "p")
    table = tmp_path / "DrawBench.csv"
    rows = [f'"{p}",{"Colors" if i < 5 else "Text"}' for i, p in enumerate(eval_prompts)]
    table.write_text("\r\n".join(["Prompts,Category", *rows]) + "\r\n")
    run_dir = str(tmp_path / "run")
    r = hpcnft("run", "tiny", "--steps", "1", "--run-dir", run_dir, "--set", f"data.train_prompts={path}",
               "--set", f"data.eval_prompts=drawbench:{table}#Colors", "--set", "checkpoint.at_end=false",
               "--set", "eval.at_end=false")
    counted = len(prompts) + 5  # the train prompts and the eval prompts of "Colors" (eval.num_prompts is 8)
    expected = (f"2 of {counted} prompts (train and eval) are longer than the text encoders take and are truncated: "
                "CLIP cuts 1 (over 77 tokens), T5 cuts 2 (over rollout.max_sequence_length = 16 tokens)")
    assert r.stderr.count("truncated") == 1, r.stderr
    assert f"hpcnft: warning: {expected}" in r.stderr.splitlines()
    with open(os.path.join(run_dir, "logs", "rank0.log")) as f:
        assert f.read().count(expected) == 1
    assert [(e["kind"], e["text"]) for e in read_run(run_dir).events if e["kind"] == "warning"] == \
        [("warning", expected)]

    # step 1's grid: 16 images (sample_grid_images), 8 from each train rank, 4 prompts x 4 samples
    grid = np.asarray(Image.open(os.path.join(run_dir, "samples", "step_000001.png")).convert("RGB"))
    side = 64
    head = grid.shape[0] - 4 * side
    assert grid.shape[1] == 4 * side and 0 < head < side, grid.shape
    cells = [grid[head + r * side:head + (r + 1) * side, c * side:(c + 1) * side] for c in range(4) for r in range(4)]
    assert all(cell.std() > 0 for cell in cells)  # every cell holds an image, none is blank
    assert len({cell.tobytes() for cell in cells}) == 16
