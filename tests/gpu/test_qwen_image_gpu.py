"""Qwen-Image on the GPU: `tiny_qwen_image` (true CFG) in bf16 in the 2+1 layout over NCCL (one
GPU, each rank a host of its own), bit-identical twice; on one train rank the same rollouts as on
two FSDP2 shards; and the Qwen-Image sampler against QwenImagePipeline on CUDA, with guidance."""
from __future__ import annotations

import torch

from jobs import assert_same_metrics, assert_step_one_agrees, hpcnft
from hpcnft.io.runfile import read_run

NCCL = ["--set", "layout.device=cuda", "--set", "layout.backend=nccl", "--set", "layout.emulate_hosts=true",
        "--set", "layout.timeout_s=60"]
BF16 = ["--set", "train.precision=bf16"]


def test_tiny_qwen_image_two_plus_one_in_bf16_over_nccl_twice_bit_identical_and_on_one_train_rank(
        tmp_path, hpcnft_cache):
    runs = [str(tmp_path / name) for name in ("a", "b")]
    for run_dir in runs:
        hpcnft("run", "tiny_qwen_image", "--steps", "3", "--run-dir", run_dir, *NCCL, *BF16, timeout=600)
    got = read_run(runs[0])
    assert got.topology["backend"] == "nccl" and got.topology["world_size"] == 3
    assert got.metrics["train/nft_loss"][:, 0].tolist() == [1.0, 2.0, 3.0]
    assert_same_metrics(*runs)
    one = str(tmp_path / "one")
    hpcnft("run", "tiny_qwen_image", "--steps", "1", "--run-dir", one, *NCCL, *BF16, "--set", "layout.train_ranks=1",
           "--set", "perf.skip_single_rank_fsdp=true", timeout=600)
    assert_step_one_agrees(runs[0], one)


def test_qwen_image_euler_matches_qwenimagepipeline_on_cuda(tmp_path):
    """Bit for bit unguided; with true CFG the family runs the negative and the conditional pass as
    one batch where the pipeline runs two, which CUDA's kernels may round otherwise: close."""
    from hpcnft.algo.sampler import PromptEncoder, euler_sample, null_autocast
    from hpcnft.models.families import QWEN_IMAGE
    from hpcnft.models.families.qwen_image import pack, unpack
    from hpcnft.models.tiny_qwen_image import build_tiny_qwen_image

    cuda = torch.device("cuda")
    (tmp_path / "qwen").mkdir()
    pipe = QWEN_IMAGE.load(build_tiny_qwen_image(str(tmp_path / "qwen")), torch.float32, cuda)
    pipe.transformer.to(cuda)
    shape = QWEN_IMAGE.latent_shape(pipe, 128, 128)
    noise = torch.randn((2, *shape), generator=torch.Generator().manual_seed(1)).to(cuda)
    sigmas = QWEN_IMAGE.sigma_grid(pipe.scheduler, 10, shape)
    for scale in (1.0, 4.0):
        cond = PromptEncoder(pipe, 24, cuda, cfg=scale > 1)(["a fox sleeping under a tree in autumn",
                                                             "a red sports car"])
        ours = euler_sample(pipe.transformer, noise.clone(), sigmas, cond, scale, torch.float32, null_autocast)
        negative = dict(negative_prompt_embeds=cond.neg_prompt_embeds, negative_prompt_embeds_mask=cond.neg_pooled) \
            if scale > 1 else {}
        theirs = pipe(prompt_embeds=cond.prompt_embeds, prompt_embeds_mask=cond.pooled, latents=pack(noise),
                      true_cfg_scale=scale, num_inference_steps=10, height=128, width=128, output_type="latent",
                      **negative).images
        if scale == 1.0:
            assert torch.equal(ours, unpack(theirs, *shape[1:]))
        else:
            torch.testing.assert_close(ours, unpack(theirs, *shape[1:]), rtol=1e-4, atol=1e-4)
