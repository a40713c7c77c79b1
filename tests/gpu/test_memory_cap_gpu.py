"""Under a GPU memory cap (`hpcnft bench --memory-cap-gib`): a tiny iteration with the text
encoders offloaded and the VAE in slices, and SD3.5-M's real-shape train step at the 24 GB
rung's settings, each run and recorded as fitting; a tiny 2+1 job with offloaded encoders ends
bit-identical to one without; under perf.fsdp_cpu_offload a full fine-tune's state lives in
pinned CPU memory and its 2+1 job over NCCL resumes bit for bit; so does a job whose base is
stored in fp8 (perf.base_fp8_storage), its e4m3 shards all-gathered by NCCL; the base's fp32
transformer never reaches the GPU (a run loads it on the host, Policy casts and stores it first)."""
from __future__ import annotations

import json

from jobs import assert_resumed_after_step_one_is_uninterrupted, assert_same_metrics, hpcnft

NCCL = ["--set", "layout.device=cuda", "--set", "layout.backend=nccl", "--set", "layout.emulate_hosts=true",
        "--set", "layout.timeout_s=60"]


def test_a_tiny_iteration_runs_under_a_cap_with_its_encoders_offloaded(tmp_path, hpcnft_cache):
    out = tmp_path / "caps.json"
    hpcnft("bench", "--shapes", "tiny", "--no-default", "--phases", "iteration", "--text-encoders", "real",
           "--set", "perf.text_encoders=\"offload\"", "--set", "perf.vae_decode_batch=2",
           "--memory-cap-gib", "2", "--json", str(out), timeout=600)
    doc = json.loads(out.read_text())
    [entry] = doc["memory_caps"]
    assert entry["memory_cap_gib"] == 2 and entry["fits"] and 0 < entry["peak_gib"] <= 2
    assert entry["overrides"]["perf.text_encoders"] == "offload" and entry["iteration_s"] > 0
    # the attempt's peak covers the warm-up (which compiles) and the build, not just the timed call
    timed = doc["stacks"][entry["stack"]]["phases"]["iteration"]
    assert 0 < timed["warm_peak_gib"] <= entry["peak_gib"] and timed["peak_gib"] <= entry["peak_gib"]


def test_the_24gb_rungs_real_shape_train_step_fits_24_gib(tmp_path, hpcnft_cache):
    out = tmp_path / "caps.json"
    hpcnft("bench", "--shapes", "sd35m", "--no-default", "--phases", "train", "--own-shapes",
           "--memory-cap-gib", "24", "--json", str(out), timeout=600)
    doc = json.loads(out.read_text())
    entry = doc["memory_caps"][0]
    assert entry["recipe"] == "sd35m_pickscore_24gb" and entry["fits"] and entry["peak_gib"] <= 24
    # under a cap no FLOPs are counted: the count's eager pass needs more than the step (Bench.flops_of)
    assert all("flops" not in m for m in doc["stacks"][entry["stack"]]["phases"].values())


def test_embeddings_are_cached_off_the_gpu_and_an_offloaded_pass_leaves_the_pinned_weights_in_place(tiny_models):
    import torch

    from hpcnft.algo.sampler import PromptEncoder
    from hpcnft.models.families import family_named

    family = family_named("sd3")
    cuda = torch.device("cuda")
    pipe = family.load(tiny_models[0], torch.float16, cuda, cuda)
    resident = PromptEncoder(pipe, 16, cuda, cfg=True)
    on_device = resident(["a cat"])
    # a run's cached embeddings (up to 11 GB for SD3.5) stay off the GPU, encoders there or not
    assert on_device.prompt_embeds.device.type == "cuda"
    assert all(pe.device.type == "cpu" and pooled.device.type == "cpu" for pe, pooled in resident.cache.values())
    for enc in family.text_encoders(pipe):
        enc.to("cpu")
    encoder = PromptEncoder(pipe, 16, cuda, cfg=True, offload=True)
    encoder.prepare(["a cat"])
    weights = [t for enc in family.text_encoders(pipe) for t in (*enc.parameters(), *enc.buffers())]
    pointers = [t.data_ptr() for t in weights]
    assert all(t.device.type == "cpu" and t.is_pinned() for t in weights)
    encoder(["a dog"])  # a second pass: a device copy made and dropped, nothing copied back
    assert [t.data_ptr() for t in weights] == pointers and all(t.is_pinned() for t in weights)
    got = encoder(["a cat"])
    assert got.prompt_embeds.device.type == "cuda" and torch.equal(got.prompt_embeds, on_device.prompt_embeds)


def test_offloaded_text_encoders_change_no_bit_of_a_tiny_job(tmp_path, hpcnft_cache):
    runs = [str(tmp_path / name) for name in ("device", "offload")]
    for run_dir, place in zip(runs, ("device", "offload")):
        hpcnft("run", "tiny", "--steps", "2", "--run-dir", run_dir, *NCCL, "--set", f"perf.text_encoders=\"{place}\"",
               timeout=600)
    assert_same_metrics(*runs)


FULL_OFFLOAD = ["--set", "train.finetune=\"full\"", "--set", "perf.fsdp_cpu_offload=true"]


def test_fsdp_cpu_offload_keeps_a_full_fine_tunes_weights_gradients_and_adamw_state_in_pinned_cpu_memory(hpcnft_cache):
    import torch

    from hpcnft.bench.shapes import _MESH, tiny_shapes
    from hpcnft.bench.stack import HpcnftStack
    from hpcnft.common.tensors import local_shard

    stack = HpcnftStack("t", "t", tiny_shapes(), torch.device("cuda"),
                        {"train.finetune": "full", "perf.fsdp_cpu_offload": True, "rollout.batch_size": 4})
    try:
        stack.iteration()[0]()  # rollout, train step (gradient clipping over the gloo backend), EMA
        params = stack.policy.trainable
        shards = [local_shard(p) for p in params]
        assert shards and all(t.device.type == "cpu" and t.is_pinned() for t in shards)
        state = [t for p in params for t in stack.trainer.optimizer.state[p].values() if torch.is_tensor(t) and t.ndim]
        assert state and all(t.device.type == "cpu" for t in state)
        assert all(s.device.type == "cpu" for s in stack.policy.shadow)
    finally:
        stack.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        _MESH.clear()


def test_an_offloaded_full_fine_tune_over_nccl_resumes_bit_for_bit(tmp_path, hpcnft_cache):
    assert_resumed_after_step_one_is_uninterrupted(tmp_path, *NCCL, *FULL_OFFLOAD)


def test_an_fp8_base_job_over_nccl_all_gathers_its_e4m3_shards_and_resumes_bit_for_bit(tmp_path, hpcnft_cache):
    fp8_base = ["--set", "perf.base_fp8_storage=true", "--set", 'train.precision="fp16"']
    done = assert_resumed_after_step_one_is_uninterrupted(tmp_path, *NCCL, *fp8_base)
    assert "perf.base_fp8_storage: the blocks' frozen linears hold" in done.stdout


def wide_sd3_folder(tiny_dir: str, out) -> str:
    """The tiny SD3.5 folder with a wider transformer (width 1024, 4 blocks: 0.4 GB in fp32), so that
    what reaches the GPU is measured well above the allocator's rounding of small tensors."""
    import shutil

    import torch
    from diffusers import SD3Transformer2DModel

    shutil.copytree(tiny_dir, out)
    config = SD3Transformer2DModel.load_config(f"{out}/transformer")
    config.update(attention_head_dim=64, num_attention_heads=16, caption_projection_dim=1024, num_layers=4)
    torch.manual_seed(0)
    SD3Transformer2DModel.from_config(config).save_pretrained(f"{out}/transformer")
    return str(out)


def test_the_fp32_transformer_is_cast_and_stored_on_the_host_before_it_reaches_the_gpu(tiny_models, tmp_path):
    import torch

    from hpcnft.algo.policy import Policy
    from hpcnft.algo.root_config import load_config
    from hpcnft.bench.shapes import _MESH, world1_mesh
    from hpcnft.models.families import family_named

    cuda = torch.device("cuda", torch.cuda.current_device())
    cfg = load_config("tiny", ["perf.base_fp8_storage=true", 'train.precision="fp16"'])
    folder = wide_sd3_folder(tiny_models[0], tmp_path / "sd35_wide")
    mesh = world1_mesh(cuda)
    try:
        torch.cuda.empty_cache()
        start = torch.cuda.memory_allocated(cuda)
        torch.cuda.reset_peak_memory_stats(cuda)
        pipe = family_named("sd3").load(folder, torch.float32, cuda, torch.device("cpu"))
        fp32_bytes = sum(p.numel() * 4 for p in pipe.transformer.parameters())
        vae_bytes = sum(t.numel() * t.element_size() for t in (*pipe.vae.parameters(), *pipe.vae.buffers()))
        policy = Policy(cfg, pipe.transformer, cuda, mesh)
        assert policy.base_storage and next(policy.transformer.parameters()).device == cuda
        # fp8 block linears, the rest in fp16, fp32 adapters: a third of the fp32 copy that a
        # load onto the device would have held first
        assert torch.cuda.max_memory_allocated(cuda) - start - vae_bytes < 0.5 * fp32_bytes
    finally:
        torch.distributed.destroy_process_group()
        _MESH.clear()
