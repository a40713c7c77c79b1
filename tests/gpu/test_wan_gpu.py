"""Wan2.1 video on the GPU: `tiny_wan` in bf16 in the 2+1 layout over NCCL (one GPU, each rank a
host of its own; the frames travel to the reward rank over NCCL too), bit-identical twice; the
layouts over NCCL make the same videos, and a layout-invariant run resumes across layouts bit for
bit; the Wan sampler with CFG against WanPipeline on CUDA."""
from __future__ import annotations

import torch

import pytest

from jobs import assert_same_metrics, hpcnft, non_perf
from hpcnft.io.runfile import read_run

NCCL = ["--set", "layout.device=cuda", "--set", "layout.backend=nccl", "--set", "layout.emulate_hosts=true",
        "--set", "layout.timeout_s=60", "--set", "layout.reward_transport=nccl"]
BF16 = ["--set", "train.precision=bf16"]


def test_tiny_wan_two_plus_one_in_bf16_over_nccl_twice_bit_identical(tmp_path, hpcnft_cache):
    runs = [str(tmp_path / name) for name in ("a", "b")]
    for run_dir in runs:
        hpcnft("run", "tiny_wan", "--steps", "3", "--run-dir", run_dir, *NCCL, *BF16, timeout=600)
    got = read_run(runs[0])
    assert got.topology["backend"] == "nccl" and got.topology["world_size"] == 3
    assert got.metrics["train/nft_loss"][:, 0].tolist() == [1.0, 2.0, 3.0]
    assert_same_metrics(*runs)


def run(run_dir: str, *args: str, steps: str = "2"):
    return hpcnft("run", "tiny_wan", "--steps", steps, "--run-dir", run_dir, *NCCL, *args, timeout=600)


@pytest.fixture(scope="module")
def two_plus_one(tmp_path_factory, hpcnft_cache):
    run_dir = str(tmp_path_factory.mktemp("wan-nccl") / "2+1")
    run(run_dir)
    return run_dir


@pytest.mark.parametrize("train,reward", [(1, 1), (4, 1), (2, 2)], ids=["1+1", "4+1", "2+2"])
def test_a_wan_layout_over_nccl_makes_the_same_videos(two_plus_one, tmp_path, train, reward):
    """The same frames and scores whichever rank made them: samples are keyed by global index."""
    run_dir = str(tmp_path / f"{train}+{reward}")
    run(run_dir, "--set", f"layout.train_ranks={train}", "--set", f"layout.reward_ranks={reward}")
    got = read_run(run_dir)
    assert got.topology["world_size"] == train + reward and got.topology["backend"] == "nccl"
    ref = non_perf(read_run(two_plus_one).metrics)
    for key in (k for k in non_perf(got.metrics) if k.startswith("rollout/reward/")):
        assert got.metrics[key][0, 1] == ref[key][0, 1], key


def test_a_layout_invariant_wan_run_resumed_as_1_plus_1_then_3_plus_1_is_bit_identical(tmp_path):
    invariant = ["--set", "determinism.layout_invariant=true", "--set", "determinism.virtual_shards=6",
                 "--set", "rollout.prompts_per_step=3", "--set", "checkpoint.every=1"]
    straight, moved = str(tmp_path / "straight"), str(tmp_path / "moved")
    run(straight, *invariant, steps="3")
    for step, train in ((1, 2), (2, 1), (3, 3)):
        run(moved, *invariant, "--set", f"layout.train_ranks={train}", steps=str(step))
    assert_same_metrics(straight, moved)


def test_wan_guided_euler_matches_wanpipeline_on_cuda(tmp_path):
    from hpcnft.algo.sampler import PromptEncoder, decode_to_uint8, euler_sample, null_autocast
    from hpcnft.models.families import WAN
    from hpcnft.models.tiny_wan import build_tiny_wan

    cuda = torch.device("cuda")
    (tmp_path / "wan").mkdir()
    pipe = WAN.load(build_tiny_wan(str(tmp_path / "wan")), torch.float32, cuda)
    pipe.transformer.to(cuda)  # the loader leaves the DiT on the host for the Policy to cast and move
    cond = PromptEncoder(pipe, 16, cuda, cfg=True)(["a fox sleeping under a tree in autumn"] * 2)
    shape = WAN.latent_shape(pipe, 128, 128, 9)
    noise = torch.randn((2, *shape), generator=torch.Generator().manual_seed(1)).to(cuda)
    sigmas = WAN.sigma_grid(pipe.scheduler, 10, shape)
    ours = euler_sample(pipe.transformer, noise.clone(), sigmas, cond, 5.0, torch.float32, null_autocast)
    theirs = pipe(prompt_embeds=cond.prompt_embeds, negative_prompt_embeds=cond.neg_prompt_embeds,
                  latents=noise.clone(), guidance_scale=5.0, num_inference_steps=10, height=128, width=128,
                  num_frames=9, output_type="latent").frames
    assert torch.equal(ours, theirs)
    assert decode_to_uint8(pipe.vae, ours, family=WAN).shape == (2, 9, 128, 128, 3)
