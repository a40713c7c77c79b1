"""A video family's frames through the reward path and the watch: the reward request carries the
frame count, the reward rank scores each frame as an image (with its video's prompt) and pools them
per video by reward.frame_pooling; diversity thumbnails keep every frame; the sample grid of videos
is a looping GIF beside the PNG of its first frames."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from hpcnft.algo.reward import make_score_fn, pool_frames
from hpcnft.algo.root_config import ConfigError, load_config
from hpcnft.algo.watch import thumbnails
from hpcnft.distributed.reward_service import EVAL, ROLLOUT, RewardServiceError, validate_header
from hpcnft.rewards.registry import job_terms, load_term
from hpcnft.run.output import save_grid

JPEG = 'reward.terms=[{kind="jpeg_compressibility", name="small"}]'


def videos(n: int, frames: int, side: int = 32) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    smooth = torch.linspace(0, 255, side).to(torch.uint8).view(1, 1, side, 1, 1).expand(n, frames, side, side, 3)
    noisy = torch.randint(0, 256, (n, frames, side, side, 3), generator=g, dtype=torch.uint8)
    mix = torch.rand(n, frames, 1, 1, 1, generator=g) < 0.5  # some frames noisy, some smooth
    return torch.where(mix, noisy, smooth).contiguous()


@pytest.mark.parametrize("pooling", ["mean", "min", "max"])
def test_each_frame_is_scored_as_an_image_and_pooled_per_video(pooling):
    cfg = load_config("tiny_wan", [JPEG, f"reward.frame_pooling={pooling}"])
    terms = {t.name: load_term(t, cfg, torch.device("cpu")) for t in job_terms(cfg)}
    score = make_score_fn(cfg, terms)
    clips = videos(3, 5)
    per_frame = torch.stack([terms["small"](["x"] * 5, clip) for clip in clips])  # [3, 5]
    got = score(ROLLOUT, 1, clips, [0, 1, 2])
    assert got.shape == (3, 1)
    assert torch.equal(got[:, 0], pool_frames(per_frame, pooling))
    assert torch.equal(score(EVAL, 0, clips, [0, 1, 2])[:, 0], got[:, 0])
    assert len(set(per_frame.flatten().tolist())) > 2  # the frames differ: the pooling decides


def test_the_pooling_is_a_choice():
    assert pool_frames(torch.tensor([[1.0, 3.0, 2.0]]), "min").item() == 1.0
    with pytest.raises(ConfigError, match="reward.frame_pooling"):
        load_config("tiny_wan", ["reward.frame_pooling=median"])


def test_a_request_of_frames_is_bounded_by_its_bytes():
    validate_header([ROLLOUT, 1, 4, 64, 64, 5])
    with pytest.raises(RewardServiceError, match="malformed request: 8 videos of 4096 frames of 512x512"):
        validate_header([ROLLOUT, 1, 8, 512, 512, 4096])
    with pytest.raises(RewardServiceError, match="malformed request"):
        validate_header([ROLLOUT, 1, 4, 64, 64, -1])


def test_a_videos_thumbnails_keep_every_frame():
    clips = videos(2, 3)
    thumbs = thumbnails(clips)
    assert thumbs.shape == (2, 3 * 3 * 32 * 32)
    assert torch.equal(thumbs[1].reshape(3, -1)[2], thumbnails(clips[1, 2:3])[0])


def test_the_grid_of_videos_is_a_looping_gif_beside_its_first_frames(tmp_path):
    clips = videos(4, 5)
    png = save_grid(str(tmp_path), 3, clips, ["a cat", "a cat", "a dog", "a dog"])
    still = Image.open(png)
    gif = Image.open(png[:-4] + ".gif")
    assert gif.n_frames == 5 and gif.info["loop"] == 0 and gif.size == still.size
    shown = []
    for k in (0, 4):
        gif.seek(k)
        shown.append(np.asarray(gif.convert("RGB")))
    assert not torch.equal(clips[:, 0], clips[:, 4]) and not np.array_equal(*shown)  # it moves
