"""Wan2.1 video on the GPU: `tiny_wan` in bf16 in the 2+1 layout over NCCL (one GPU, each rank a
host of its own; the frames travel to the reward rank over NCCL too), bit-identical twice; and the
Wan sampler with CFG against WanPipeline on CUDA."""
from __future__ import annotations

import torch

from jobs import assert_same_metrics, hpcnft
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


def test_wan_guided_euler_matches_wanpipeline_on_cuda(tmp_path):
    from hpcnft.algo.sampler import PromptEncoder, decode_to_uint8, euler_sample, null_autocast
    from hpcnft.models.families import WAN
    from hpcnft.models.tiny_wan import build_tiny_wan

    cuda = torch.device("cuda")
    (tmp_path / "wan").mkdir()
    pipe = WAN.load(build_tiny_wan(str(tmp_path / "wan")), torch.float32, cuda)
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
