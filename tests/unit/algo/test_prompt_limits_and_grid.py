"""What the text encoders cut (sampler.truncated_prompts), the sample grid's layout
(sampler.prompt_grid) and its images from every train rank (Learner.grid_images over gloo)."""
from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpcnft.algo.iteration import Learner
from hpcnft.algo.prompts import PromptStream
from hpcnft.algo.sampler import grid_cells, grid_sample_ids, prompt_grid, truncated_prompts
from hpcnft.distributed.spawner import free_port


@pytest.fixture(scope="module")
def pipe(tiny_models):
    from hpcnft.models.loading import load_sd3_pipeline

    return load_sd3_pipeline(tiny_models[0], torch.float32, torch.device("cpu"))


def _words_to_length(tok, limit: int, word: str = "cat") -> str:
    """The shortest repetition of `word` whose token count (special tokens included) is `limit`."""
    text = word
    while len(tok(text)["input_ids"]) < limit:
        text += f" {word}"
    assert len(tok(text)["input_ids"]) == limit
    return text


def test_counts_what_each_encoder_cuts_at_its_own_limit(pipe):
    msl = 16
    at_clip = _words_to_length(pipe.tokenizer, pipe.tokenizer_max_length)  # 77 tokens: kept whole
    over_clip = at_clip + " cat"
    at_t5 = _words_to_length(pipe.tokenizer_3, msl)
    over_t5 = at_t5 + " cat"
    assert len(pipe.tokenizer(over_t5)["input_ids"]) <= pipe.tokenizer_max_length  # cut by T5 only
    prompts = ["a cat", at_t5, over_t5, over_clip, over_clip, "a dog"]
    n, by = truncated_prompts(pipe, prompts, msl)
    # over_clip is cut by both (counted once per line, and twice: it is listed twice)
    assert (n, by) == (3, {"CLIP": 2, "T5": 3})
    assert truncated_prompts(pipe, ["a cat", at_t5], msl) == (0, {"CLIP": 0, "T5": 0})
    assert truncated_prompts(pipe, [at_clip], pipe.tokenizer_max_length + 1)[1]["CLIP"] == 0


def test_grid_has_a_column_per_prompt_with_its_images_in_order():
    images = np.stack([np.full((8, 6, 3), 10 * i, np.uint8) for i in range(7)])
    prompts = ["p0"] * 4 + ["p1"] * 3
    grid = prompt_grid(images, prompts)
    head = grid.shape[0] - 4 * 8
    assert grid.shape[1] == 2 * 6 and head > 0
    for i in range(7):
        col, row = (0, i) if i < 4 else (1, i - 4)
        cell = grid[head + row * 8:head + (row + 1) * 8, col * 6:(col + 1) * 6]
        assert (cell == 10 * i).all(), i
    assert (grid[head + 3 * 8:, 6:] == 255).all()  # the shorter column ends in white
    assert (grid[:head] < 255).any()  # a caption is drawn


def _grid_rank(rank: int, port: int, n: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        cfg = SimpleNamespace(samples_per_step=16, rollout=SimpleNamespace(prompts_per_step=4, samples_per_prompt=4))
        me = SimpleNamespace(
            cfg=cfg, group=dist.new_group([0, 1]),
            topo=SimpleNamespace(rank=rank, train_ranks=[0, 1], comm_device=torch.device("cpu")),
            stream=PromptStream([f"prompt {i}" for i in range(10)], False, 0))
        # rank r's rollout images are its samples r*8 .. r*8+7; image i is filled with i
        images = torch.stack([torch.full((4, 4, 3), rank * 8 + j, dtype=torch.uint8) for j in range(8)])
        got = Learner.grid_images(me, 2, images, n)
        if rank == 0:
            torch.save({"images": got[0], "prompts": got[1]}, out)
        else:
            assert got is None
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("n, samples", [(16, list(range(16))), (8, [0, 1, 2, 3, 8, 9, 10, 11]),
                                        (5, [0, 1, 2, 8, 9])])
def test_grid_images_are_every_train_ranks_share_with_their_prompts(tmp_path, n, samples):
    out = str(tmp_path / "grid.pt")
    mp.start_processes(_grid_rank, args=(free_port(), n, out), nprocs=2, start_method="spawn")
    got = torch.load(out)
    assert got["images"].shape == (len(samples), 4, 4, 3)
    assert [int(im[0, 0, 0]) for im in got["images"]] == samples
    # step 2 takes prompts 4..7 of the stream; sample i is prompt i // 4's
    assert got["prompts"] == [f"prompt {4 + i // 4}" for i in samples]
    assert grid_sample_ids(16, 2, n) == samples  # what `hpcnft score` finds the grid's prompts from


def test_a_grids_cells_are_its_images_again():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (7, 8, 6, 3), dtype=np.uint8)
    prompts = ["p0"] * 2 + ["a longer prompt that wraps"] * 4 + ["p2"]
    grid = prompt_grid(images, prompts)
    assert np.array_equal(grid_cells(grid, prompts, 8, 6), images)
    with pytest.raises(ValueError, match="is not one of 5 images of 6x8 in 2 columns"):
        grid_cells(grid, prompts[2:], 8, 6)
