"""hpcnft bench's pure parts and the one matmul ceiling of hpcnft.perf.mfu (CPU, small sizes)."""
import pytest
import torch

from hpcnft.bench.profiling import CATEGORIES, categorize, kernel_category
from hpcnft.bench.timing import matmul_ceiling as bench_ceiling
from hpcnft.perf.mfu import matmul_ceiling, measure_matmul

KERNELS = {
    "ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_nn": "gemm",
    "sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off": "gemm",
    "nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NNT": "gemm",
    "void cutlass::Kernel2<cutlass_80_tensorop_f16_s16816gemm_relu_f16_64x64_32x10_nn_align8>(Params)": "gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __half, float, __half>(...)": "gemm",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4>, true>(Flash_fwd_params)":
        "attention_fwd",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64>>(...)":
        "attention_bwd",
    "fmha_cutlassF_f16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)":
        "attention_fwd",
    "fmha_cutlassB_f16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<...>::Params)":
        "attention_bwd",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x64_4x1x1_kernel0_0": "attention_fwd",
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_1_64x128x64_4x1x1_kernel0_0": "attention_bwd",
    "triton_poi_fused__scaled_dot_product_flash_attention_0": "triton",
    "triton_per_fused_native_layer_norm_1": "triton",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::Half>>(...)": "other",
    "Memcpy HtoD (Pageable -> Device)": "other",
}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_category(name):
    assert kernel_category(name) == KERNELS[name]


def test_categorize_sums_seconds_and_shares():
    out = categorize([("nvjet_hsh_128x256", 3.0), ("flash_fwd_kernel", 1.0), ("flash_bwd_kernel", 2.0),
                      ("triton_poi_fused_add_0", 1.5), ("elementwise_kernel", 0.5), ("sm90_xmma_gemm", 2.0)])
    assert out["total_s"] == 10.0
    assert set(out["categories"]) == set(CATEGORIES)
    assert {c: v["s"] for c, v in out["categories"].items()} == {
        "gemm": 5.0, "attention_fwd": 1.0, "attention_bwd": 2.0, "triton": 1.5, "other": 0.5}
    assert out["categories"]["gemm"]["share"] == 0.5
    assert sum(v["share"] for v in out["categories"].values()) == pytest.approx(1.0)


def test_categorize_nothing():
    out = categorize([])
    assert out["total_s"] == 0.0 and all(v == {"s": 0.0, "share": 0.0} for v in out["categories"].values())


def test_one_matmul_ceiling_for_the_loop_and_the_bench():
    cpu = torch.device("cpu")
    state = torch.get_rng_state()
    m = measure_matmul(cpu, torch.float32, n=64, warm=1, reps=3)
    assert torch.equal(state, torch.get_rng_state())  # a private generator: the run's RNG is untouched
    assert m["n"] == 64 and m["dtype"] == "float32" and len(m["runs_s"]) == 3
    assert m["flops_per_s"] == pytest.approx(2 * 64**3 / m["s"])
    assert matmul_ceiling(cpu, torch.float16) > 0  # fp32 on a CPU, whatever the compute dtype
    assert set(bench_ceiling(cpu, 64)) == {"fp32_tflops"}


class _Avg:
    def __init__(self, key, count, cpu_us, device_us):
        self.key, self.count, self.cpu_time_total, self.device_time_total = key, count, cpu_us, device_us


def test_spans_take_host_time_from_the_host_range_and_device_time_from_the_gpu_timeline():
    from hpcnft.bench.profiling import spans

    # as torch.profiler lists them on a GPU: the host range (its device total counts the launch
    # queue's waits) and the same range on the GPU timeline, in either order
    host = _Avg("hpcnft/train/old_pass", 1, 3.0e6, 6.0e6)
    gpu = _Avg("hpcnft/train/old_pass", 1, 0.0, 3.1e6)
    other = _Avg("aten::mm", 10, 1.0e6, 2.0e6)
    for rows in ([host, gpu, other], [gpu, host, other]):
        assert spans(rows) == {"train/old_pass": {"calls": 1, "cpu_s": 3.0, "device_s": 3.1}}
    # a CPU run: one range, its device time 0
    assert spans([_Avg("hpcnft/rollout/sample", 2, 1.5e6, 0.0)]) == {
        "rollout/sample": {"calls": 2, "cpu_s": 1.5, "device_s": 0.0}}


def test_launch_queue_waits_and_named_ranges_are_not_kernels():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from hpcnft.bench.profiling import _timeline

    def ev(name, us, dt=DeviceType.CUDA, annotation=False):
        return SimpleNamespace(name=name, device_type=dt, is_user_annotation=annotation,
                               time_range=SimpleNamespace(start=0.0, end=us))
    prof = SimpleNamespace(events=lambda: [ev("nvjet_sm90_gemm", 10.0), ev("Command Buffer Full", 500.0),
                                           ev("hpcnft/train/step", 900.0, annotation=True),
                                           ev("aten::mm", 12.0, DeviceType.CPU)])
    kernels, _ = _timeline(prof)
    assert [(name, end - start) for start, end, name in kernels] == [("nvjet_sm90_gemm", 1e-5)]


def test_fp8_passes_do_not_meet_the_fp16_share_targets():
    from hpcnft.bench.report import targets
    from hpcnft.bench.shapes import sd35m_shapes

    def doc(over):
        return {"stacks": {"hpcnft_fast": {"config": {"overrides": over}, "rollout_batch": 32, "micro_batch": 32,
                                           "phases": {"rollout_fwd_b32": {"mfu": 0.79},
                                                      "train_pair_mb32": {"mfu": 0.66}}}}}
    plain = targets(doc({}), sd35m_shapes())
    assert plain["rollout_fwd_mfu"]["met"] is True and plain["train_pair_mfu"]["met"] is True
    fp8 = targets(doc({"perf.rollout_fp8": True}), sd35m_shapes())
    assert fp8["rollout_fwd_mfu"]["met"] is None and fp8["rollout_fwd_mfu"]["value"] == 0.79
    assert "fp8" in fp8["rollout_fwd_mfu"]["note"] and fp8["train_pair_mfu"]["met"] is True
    v_old = targets(doc({"perf.v_old_fp8": True}), sd35m_shapes())  # the train pair's v_old pass in fp8
    assert v_old["train_pair_mfu"]["met"] is None and "v_old_fp8" in v_old["train_pair_mfu"]["note"]
    assert v_old["rollout_fwd_mfu"]["met"] is True


def test_idle_gaps_are_charged_to_what_the_host_was_doing():
    from hpcnft.bench.profiling import idle_gaps

    kernels = [(0.000, 0.010, "gemm_a"), (0.005, 0.012, "other_stream"),  # overlapping streams: busy to 12 ms
               (0.0121, 0.020, "gemm_b"),  # a 0.1 ms gap: counted in every_gap_s only
               (0.050, 0.060, "triton_c"),  # a 30 ms gap while the host ran the optimizer after a sync
               (0.061, 0.070, "gemm_d")]  # 1 ms, inside the micro-batch range, no op open
    host = [(0.0, 0.1, "hpcnft/train/step"), (0.021, 0.049, "hpcnft/train/optimizer"),
            (0.022, 0.048, "Optimizer.step#AdamW.step"), (0.030, 0.031, "aten::add_"),
            (0.055, 0.075, "hpcnft/train/micro_batch")]
    out = idle_gaps(kernels, host, min_gap_s=5e-4)
    assert out["gaps"] == 2
    assert out["every_gap_s"] == pytest.approx(0.0001 + 0.030 + 0.001)
    assert out["total_s"] == pytest.approx(0.031)
    first, second = out["top"]
    assert first["s"] == pytest.approx(0.030) and first["at_s"] == pytest.approx(0.020)
    assert (first["span"], first["host_op"], first["after"], first["before"]) == (
        "train/optimizer", "Optimizer.step#AdamW.step", "gemm_b", "triton_c")
    assert (second["span"], second["host_op"]) == ("train/micro_batch", "-")
    # every gap by range: the 0.1 ms one, too short for `top`, is the step's own
    assert list(out["by_span"]) == ["train/optimizer", "train/micro_batch", "train/step"]
    assert out["by_span"]["train/optimizer"] == {"gaps": 1, "s": pytest.approx(0.030), "long_gaps": 1,
                                                 "long_s": pytest.approx(0.030)}
    assert out["by_span"]["train/step"] == {"gaps": 1, "s": pytest.approx(0.0001), "long_gaps": 0, "long_s": 0.0}


def test_top_kernels_sum_device_time_by_name():
    from hpcnft.bench.profiling import top_kernels

    out = top_kernels([("gemm", 2.0), ("triton_a", 0.5), ("gemm", 1.0), ("triton_b", 0.5)], n=2)
    assert out == [{"name": "gemm", "calls": 2, "s": 3.0, "share": 0.75},
                   {"name": "triton_a", "calls": 1, "s": 0.5, "share": 0.125}]


def test_no_kernels_no_gaps():
    from hpcnft.bench.profiling import idle_gaps

    assert idle_gaps([], [(0.0, 1.0, "hpcnft/x")])["gaps"] == 0


def test_fp32_arithmetic_upcasts_a_half_module_exactly_and_puts_it_back():
    from hpcnft.bench.stack import fp32_arithmetic

    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(16, 8).half()
    lin.register_buffer("fused", torch.randn(4, generator=g).half(), persistent=False)
    lin.bias.requires_grad_(False)
    originals = {n: (t, t.data.clone(), t.data_ptr()) for n, t in
                 list(lin.named_parameters()) + list(lin.named_buffers())}
    x = torch.randn(3, 16, generator=g)
    precision = torch.get_float32_matmul_precision()
    with fp32_arithmetic(lin):
        assert all(t.dtype == torch.float32 for t in list(lin.parameters()) + list(lin.buffers()))
        assert all(torch.equal(t.data, data.float()) for t, data, _ in originals.values())  # exact upcast
        assert torch.get_float32_matmul_precision() == "highest"
        y = lin(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, x @ originals["weight"][1].float().t() + originals["bias"][1].float(),
                               rtol=0, atol=1e-6)
    for name, (t, data, ptr) in originals.items():  # the same storage, the same bits, the same dtype
        assert t.dtype == torch.float16 and t.data_ptr() == ptr and torch.equal(t.data, data), name
    assert lin.weight.requires_grad and not lin.bias.requires_grad
    assert torch.get_float32_matmul_precision() == precision


def test_fp32_arithmetic_runs_compiled_code_eagerly():
    """The fp32 reference must not compile the real DiT's blocks a second time, for fp32."""
    import torch._dynamo
    from hpcnft.bench.stack import fp32_arithmetic

    double = torch.compile(lambda x: x * 2, backend="eager")
    graphs = torch._dynamo.utils.counters["stats"]
    before = graphs["unique_graphs"]
    with fp32_arithmetic(torch.nn.Linear(2, 2).half()):
        assert torch.equal(double(torch.ones(3)), torch.full((3,), 2.0))
        assert graphs["unique_graphs"] == before
    double(torch.ones(3))
    assert graphs["unique_graphs"] == before + 1  # outside, compiled as usual


def test_a_phase_whose_flop_count_runs_out_of_memory_keeps_its_time(tmp_path):
    # the count is an eager pass that can need more than the compiled call (a capped card)
    import argparse
    import contextlib
    import json

    from hpcnft.bench.run import Bench
    from hpcnft.bench.shapes import tiny_shapes

    calls = []

    def fn():
        calls.append(1)
        if len(calls) > 3:  # warm-up and two timed calls fit; the count's pass does not
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 44.00 GiB")

    args = argparse.Namespace(argv=["--shapes", "tiny"], budget_s=None, json=str(tmp_path / "b.json"))
    bench = Bench(args, tiny_shapes(), torch.device("cpu"))
    bench.doc["ceiling_tflops"] = 1.0
    rec = {"key": "s", "phases": {}}
    m = bench.phase(rec, "train_pair_mb1", lambda: (fn, contextlib.nullcontext), "pair", 1, warm=1, reps=2)
    assert m is not None and m["s"] >= 0 and "flops" not in m and "mfu" not in m
    assert m["flops_error"].startswith("OutOfMemoryError: CUDA out of memory")
    assert not bench.doc["errors"] and json.loads((tmp_path / "b.json").read_text())["stacks"] == {}
    counted = bench.phase(rec, "free", lambda: (lambda: torch.ones(2, 3) @ torch.ones(3, 4), contextlib.nullcontext),
                          "call", 1, warm=0, reps=1)
    assert counted["flops"] == 2 * 2 * 3 * 4 and "flops_error" not in counted


def test_a_tiny_phase_prints_its_rate_and_mfu_in_units_that_show_them(tmp_path, capsys):
    import argparse
    import contextlib
    import re

    from hpcnft.bench.report import _cell
    from hpcnft.bench.run import Bench
    from hpcnft.bench.shapes import tiny_shapes

    args = argparse.Namespace(argv=["--shapes", "tiny"], budget_s=None, json=None)
    bench = Bench(args, tiny_shapes(), torch.device("cpu"))
    bench.doc["ceiling_tflops"] = measure_matmul(torch.device("cpu"), torch.float32, n=256)["flops_per_s"] / 1e12
    a, b = torch.ones(16, 32), torch.ones(32, 8)
    m = bench.phase({"key": "tiny", "phases": {}}, "matmul", lambda: (lambda: a @ b, contextlib.nullcontext),
                    "call", 1, warm=1, reps=3)
    line = capsys.readouterr().err.splitlines()[-1]
    rate = re.search(r", ([0-9.]+) ([kMGT]?FLOP/s), MFU ([0-9.e-]+) %", line)
    assert rate and float(rate.group(1)) > 0 and float(rate.group(3)) > 0, line  # never "0 TFLOP/s"
    assert rate.group(2) != "TFLOP/s" and " 0.0 ms per call" not in line, line
    cell_mfu = re.search(r" · ([0-9.e-]+) %$", _cell(m))  # the report's table cell
    assert cell_mfu and float(cell_mfu.group(1)) > 0, _cell(m)
    from hpcnft.bench.report import _fmt_pct, _fmt_rate

    assert [_fmt_rate(v) for v in (4.567e9, 12.34e9, 3.2e7, 0.35e12, 650.4e12, 1979e12)] == [
        "4.57 GFLOP/s", "12.3 GFLOP/s", "32.0 MFLOP/s", "350 GFLOP/s", "650 TFLOP/s", "1979 TFLOP/s"]
    assert [_fmt_pct(f) for f in (0.00034, 0.0123, 0.45678)] == ["0.034 %", "1.2 %", "45.7 %"]
