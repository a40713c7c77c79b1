"""FLUX.1 on the GPU: `tiny_flux` in bf16 in the 2+1 layout over NCCL (one GPU, each rank a host of
its own), bit-identical twice; and the FLUX sampler against FluxPipeline on CUDA."""
from __future__ import annotations

import torch

from jobs import assert_same_metrics, hpcnft
from hpcnft.io.runfile import read_run

NCCL = ["--set", "layout.device=cuda", "--set", "layout.backend=nccl", "--set", "layout.emulate_hosts=true",
        "--set", "layout.timeout_s=60"]
BF16 = ["--set", "train.precision=bf16"]


def test_tiny_flux_two_plus_one_in_bf16_over_nccl_twice_bit_identical(tmp_path, hpcnft_cache):
    runs = [str(tmp_path / name) for name in ("a", "b")]
    for run_dir in runs:
        hpcnft("run", "tiny_flux", "--steps", "3", "--run-dir", run_dir, *NCCL, *BF16, timeout=600)
    got = read_run(runs[0])
    assert got.topology["backend"] == "nccl" and got.topology["world_size"] == 3
    assert got.metrics["train/nft_loss"][:, 0].tolist() == [1.0, 2.0, 3.0]
    assert_same_metrics(*runs)


def test_flux_euler_matches_fluxpipeline_on_cuda(tmp_path):
    from hpcnft.algo.sampler import PromptEncoder, euler_sample, null_autocast
    from hpcnft.models.families import FLUX
    from hpcnft.models.families.flux import pack, unpack
    from hpcnft.models.tiny_flux import build_tiny_flux

    cuda = torch.device("cuda")
    (tmp_path / "flux").mkdir()
    pipe = FLUX.load(build_tiny_flux(str(tmp_path / "flux")), torch.float32, cuda)
    pipe.transformer.to(cuda)  # the loader leaves the DiT on the host for the Policy to cast and move
    cond = PromptEncoder(pipe, 16, cuda, cfg=False)(["a fox sleeping under a tree in autumn"] * 2)
    shape = FLUX.latent_shape(pipe, 128, 128)
    noise = torch.randn((2, *shape), generator=torch.Generator().manual_seed(1)).to(cuda)
    sigmas = FLUX.sigma_grid(pipe.scheduler, 10, shape)
    ours = euler_sample(pipe.transformer, noise.clone(), sigmas, cond, 3.5, torch.float32, null_autocast)
    theirs = pipe(prompt_embeds=cond.prompt_embeds, pooled_prompt_embeds=cond.pooled, latents=pack(noise),
                  guidance_scale=3.5, num_inference_steps=10, height=128, width=128, output_type="latent").images
    assert torch.equal(ours, unpack(theirs, *shape[1:]))


def test_a_flux_dit_on_cuda_turns_cudnn_attention_off(tmp_path):
    from hpcnft.models.families import FLUX
    from hpcnft.models.tiny_flux import build_tiny_flux

    (tmp_path / "flux").mkdir()
    pipe = FLUX.load(build_tiny_flux(str(tmp_path / "flux")), torch.float32, torch.device("cuda"))
    pipe.transformer.to("cuda")  # where the Policy moves it before prepare_dit
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        FLUX.prepare_dit(pipe.transformer)  # as the Policy does once the DiT is on its device
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
