"""`hpcnft bench` through the real command line at the tiny shapes, on the CPU."""
import json
import math
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def hpcnft(*args, timeout=600, env=None):
    """`hpcnft ARGS` on one thread: beside other tests' jobs on a few cores, torch's idle threads
    spin for their turn and cost more CPU than they save."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
           **(env or {})}
    return subprocess.run([sys.executable, "-m", "hpcnft", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


@pytest.fixture(scope="module")
def tiny_bench(tmp_path_factory):
    """`hpcnft bench --shapes tiny --baseline --profile DIR --json FILE` on the CPU: every stack,
    every phase, and the fast stack profiled; (the result, its JSON, the profile folder)."""
    tmp = tmp_path_factory.mktemp("bench")
    out, prof = tmp / "bench.json", tmp / "prof"
    r = hpcnft("bench", "--shapes", "tiny", "--baseline", "--profile", prof, "--json", out,
               env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    return r, json.loads(out.read_text()), prof


@pytest.mark.slow
def test_bench_tiny_writes_every_phase_with_ratios(tiny_bench):
    r, doc, _ = tiny_bench
    assert doc["schema"] == "hpcnft-bench/1" and doc["shapes"] == "tiny"
    assert doc["ceiling_tflops"] > 0
    assert not doc["errors"], doc["errors"]
    stacks = doc["stacks"]
    assert set(stacks) == {"eager", "hpcnft_default", "hpcnft_fast"}
    want = {"rollout_fwd_b4", "rollout_fwd_b8", "vae_decode", "pickscore", "train_pair_mb4", "train_pair_mb8",
            "iteration"}
    assert set(stacks["eager"]["phases"]) == want
    assert set(stacks["hpcnft_default"]["phases"]) == want - {"iteration"}
    assert set(stacks["hpcnft_fast"]["phases"]) == {"rollout_fwd_b8", "vae_decode", "pickscore", "train_pair_mb8",
                                                    "iteration"}
    for key, rec in stacks.items():
        for name, m in rec["phases"].items():
            assert m["s"] > 0 and m["per_unit_s"] > 0, (key, name, m)
            if name != "iteration":
                assert m["flops"] > 0 and 0 < m["mfu"], (key, name, m)
            if key != "eager":
                assert m["speedup_vs_eager"] > 0, (key, name, m)
    fast_iter = stacks["hpcnft_fast"]["phases"]["iteration"]
    assert fast_iter["flops"] > 0 and fast_iter["metrics"]["perf/iteration_s"] > 0
    assert set(doc["targets"]) >= {"rollout_fwd_mfu", "train_pair_mfu", "iteration_s", "iteration_speedup_vs_eager"}
    # the markdown table is printed last, one row per phase
    assert "| iteration |" in r.stdout and "fast vs eager" in r.stdout


@pytest.mark.slow
def test_bench_tiny_profile_writes_tables_and_a_summary(tiny_bench):
    _, doc, prof = tiny_bench
    assert not doc["errors"], doc["errors"]
    summary = doc["stacks"]["hpcnft_fast"]["profile"]
    assert set(summary) == {"rollout_forward", "train_pairs", "iteration"}
    # the iteration's time by the package's named ranges
    it = summary["iteration"]["spans"]
    for part in ("rollout/sample", "rollout/decode", "rollout/reward_submit", "train/step", "train/old_pass",
                 "train/micro_batch", "train/optimizer"):
        assert it[part]["calls"] >= 1 and it[part]["cpu_s"] > 0, (part, it)
    assert it["train/micro_batch"]["calls"] == doc["stacks"]["hpcnft_fast"]["phases"]["iteration"]["pairs"] // 8
    spans = summary["train_pairs"]["spans"]
    assert "train/old_pass" in spans and "rollout/sample" not in spans
    assert summary["rollout_forward"]["phase"] == "rollout_fwd_b8"
    assert summary["train_pairs"]["phase"] == "train_pair_mb8"
    for name, s in summary.items():
        if name == "iteration":
            continue
        table = (prof / f"profile-{name}.txt").read_text()
        assert "Self CPU" in table and "aten::" in table, table[:2000]
        assert s["device"] == "cpu" and s["wall_s"] > 0 and s["cpu_self_time_s"] > 0, s
        assert s["top_ops"] and all(o["self_s"] >= 0 and 0 <= o["share"] <= 1 for o in s["top_ops"]), s
    assert any(o["name"] in ("aten::mm", "aten::addmm", "aten::linear") for o in summary["rollout_forward"]["top_ops"])


@pytest.mark.parametrize("shapes", ["sd35m", "sd35l", "flux1dev", "qwen_image", "wan21_1_3b"])
def test_bench_real_shapes_without_cuda_is_one_line_usage_error(shapes):
    r = hpcnft("bench", "--shapes", shapes, env={"CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "CUDA" in r.stderr and shapes in r.stderr, r.stderr


def test_bench_help_lists_every_shapes():
    r = hpcnft("bench", "--help", timeout=120)
    assert r.returncode == 0, r.stderr
    for name in ("sd35m", "sd35l", "flux1dev", "qwen_image", "wan21_1_3b", "tiny", "tiny_flux", "tiny_qwen_image",
                 "tiny_wan"):
        assert name in r.stdout, r.stdout


@pytest.mark.slow
def test_bench_tiny_flux_runs_the_plain_and_the_package_stacks(tmp_path):
    """The FLUX paths of both stacks on a CPU: the plain FluxPipeline-style diffusers + peft
    stack and the package's (FLUX family, its levers) at the tiny FLUX.1-dev's shapes."""
    from hpcnft.perf.config import SD3_ONLY_LEVERS

    out = tmp_path / "bench.json"
    r = hpcnft("bench", "--shapes", "tiny_flux", "--baseline", "--no-default", "--json", out,
               env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["shapes"] == "tiny_flux" and not doc["errors"] and not doc["skipped"], doc
    stacks = doc["stacks"]
    assert set(stacks) == {"eager", "hpcnft_fast"}
    assert set(stacks["eager"]["phases"]) == {"rollout_fwd_b4", "rollout_fwd_b8", "vae_decode", "pickscore",
                                              "train_pair_mb4", "train_pair_mb8", "iteration"}
    assert set(stacks["hpcnft_fast"]["phases"]) == {"rollout_fwd_b8", "vae_decode", "pickscore", "train_pair_mb8",
                                                    "iteration"}
    for key, rec in stacks.items():
        for name, m in rec["phases"].items():
            assert m["s"] > 0 and m["per_unit_s"] > 0 and m["peak_rss_gib"] > 0, (key, name, m)
            if name != "iteration":
                assert m["flops"] > 0 and m["mfu"] > 0, (key, name, m)
            if key != "eager":
                assert m["speedup_vs_eager"] > 0, (key, name, m)
    eager = stacks["eager"]["config"]
    assert eager["family"] == "flux" and eager["guidance"] == 3.5 and len(eager["lora_targets"]) == 12
    fast = stacks["hpcnft_fast"]["config"]["overrides"]
    assert not set(fast) & {f"perf.{k}" for k in SD3_ONLY_LEVERS} and fast["perf.merge_lora_nograd"]
    # the same DiT work in both rollouts: the plain base forward, and the package's with LoRA merged
    flops = {key: rec["phases"]["rollout_fwd_b8"]["flops"] for key, rec in stacks.items()}
    assert flops["eager"] == flops["hpcnft_fast"], flops
    it = stacks["hpcnft_fast"]["phases"]["iteration"]
    assert it["flops"] > 0 and it["metrics"]["perf/iteration_s"] > 0 and it["metrics"]["train/nft_loss"] > 0
    assert "| iteration |" in r.stdout and "fast vs eager" in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("shapes,family,unit", [("tiny_qwen_image", "qwen_image", "image"),
                                                ("tiny_wan", "wan", "video")])
def test_bench_tiny_qwen_image_and_tiny_wan_run_the_plain_and_the_package_stacks(tmp_path, shapes, family, unit):
    """The Qwen-Image paths of both stacks on a CPU (the text mask, the packed latents, the 3D VAE),
    and Wan's (video latents, CFG as two calls, every frame decoded and scored, counted per video):
    the same DiT work in both rollouts, an iteration of the package's."""
    from hpcnft.bench.shapes import SHAPES

    out = tmp_path / "bench.json"
    r = hpcnft("bench", "--shapes", shapes, "--baseline", "--no-default", "--json", out,
               env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["shapes"] == shapes and not doc["errors"] and not doc["skipped"], doc
    stacks = doc["stacks"]
    assert set(stacks) == {"eager", "hpcnft_fast"} and stacks["eager"]["config"]["family"] == family
    S = SHAPES[shapes]()
    for key, rec in stacks.items():
        for name, m in rec["phases"].items():
            assert m["s"] > 0 and (name == "iteration" or m["flops"] > 0), (key, name, m)
        assert rec["phases"]["vae_decode"]["unit"] == rec["phases"]["pickscore"]["unit"] == unit, key
        assert rec["phases"]["pickscore"]["per"] == S.samples
        assert rec["phases"]["iteration"]["pairs"] == S.samples * S.trained_steps
    flops = {key: rec["phases"]["rollout_fwd_b8"]["flops"] for key, rec in stacks.items()}
    assert flops["eager"] == flops["hpcnft_fast"], flops
    assert stacks["hpcnft_fast"]["phases"]["iteration"]["metrics"]["train/nft_loss"] > 0


@pytest.mark.slow
def test_bench_frees_each_stacks_dit_before_the_next(tmp_path):
    """After Bench.free nothing holds a stack's DiT (its Policy, Learner, compiled graphs), so the
    next stack of the real shapes never meets the last one's weights."""
    import types
    import weakref

    import torch

    from hpcnft.bench.eager import EagerStack
    from hpcnft.bench.levers import fast_overrides
    from hpcnft.bench.run import Bench
    from hpcnft.bench.shapes import _MESH, SHAPES
    from hpcnft.bench.stack import HpcnftStack

    dev = torch.device("cpu")
    S = SHAPES["tiny_flux"]()
    bench = Bench(types.SimpleNamespace(argv=[], budget_s=None, json=None), S, dev)

    def exercise(stack) -> weakref.ref:
        fn, ctx = stack.rollout_forward(4)[:2]
        with ctx():
            fn()
        fn, ctx = stack.train_pairs(4)[:2]
        with ctx():
            fn()
        stack.iteration()[0]()
        return weakref.ref(stack.dit if isinstance(stack, EagerStack) else stack.policy.transformer)

    try:
        for stack in (EagerStack(S, dev), HpcnftStack("hpcnft_fast", "fast", S, dev, fast_overrides(S, dev, []))):
            dit = exercise(stack)
            bench.free(stack)
            assert dit() is None, stack.key
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        _MESH.clear()


def test_bench_bad_lever_is_usage_error():
    r = hpcnft("bench", "--shapes", "tiny", "--levers", "compile_blocks", env={"CUDA_VISIBLE_DEVICES": ""},
               timeout=120)
    assert r.returncode == 2 and "KEY=VALUE" in r.stderr, r.stderr


@pytest.mark.slow
def test_bench_phases_and_own_shapes_choose_what_is_measured(tmp_path):
    out, prof = tmp_path / "bench.json", tmp_path / "prof"
    r = hpcnft("bench", "--shapes", "tiny", "--baseline", "--no-default", "--phases", "vae,iteration", "--own-shapes",
               "--profile", prof, "--json", out, "--set", "perf.rollout_fp8=true", env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert not doc["errors"] and not doc["skipped"], doc
    assert {k: set(v["phases"]) for k, v in doc["stacks"].items()} == {
        "eager": {"vae_decode", "iteration"}, "hpcnft_fast": {"vae_decode", "iteration"}}
    # only the iteration is profiled: the rollout forward and the train pairs were not asked for
    assert set(doc["stacks"]["hpcnft_fast"]["profile"]) == {"iteration"}
    assert "speedup_vs_eager" in doc["stacks"]["hpcnft_fast"]["phases"]["iteration"]
    # both stacks warmed alike before their timed iteration, however few phases ran before it
    assert doc["stacks"]["eager"]["phases"]["iteration"]["warm"] == 1
    assert doc["stacks"]["hpcnft_fast"]["phases"]["iteration"]["warm"] == 1
    assert "pickscore_preprocess_cost" in doc["stacks"]["hpcnft_fast"]  # the iteration scores
    # and samples: the fp8 rollout's cost, small and not nothing
    cost = doc["stacks"]["hpcnft_fast"]["rollout_fp8_cost"]
    assert 0 < cost["velocity_rel_error"] < 0.05 and 0 < cost["latent_rel_error"] < 0.05
    assert cost["pickscore_max_abs"] < cost["pickscore_std"]

    r = hpcnft("bench", "--shapes", "tiny", "--no-default", "--phases", "train", "--own-shapes", "--json", out,
               "--set", "perf.rollout_fp8=true", "--set", "perf.v_old_fp8=true", env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    fast = json.loads(out.read_text())["stacks"]["hpcnft_fast"]
    assert set(fast["phases"]) == {"train_pair_mb8"}  # FAST's micro-batch at the tiny shapes, not also the eager 4
    # nothing sampled or scored: neither lever's cost is measured (the fp8 one compiles the rollout on a GPU)
    assert "rollout_fp8_cost" not in fast and "pickscore_preprocess_cost" not in fast
    # trained: v_old's fp8 cost is, on one micro-batch — small, not nothing
    cost = fast["v_old_fp8_cost"]
    assert cost["n"] == 8 and 0 < cost["v_old_rel_error"] < 0.05 and 0 < cost["v_old_error_vs_residual"] < 0.05
    assert 0 < cost["loss_rel_error"] < 0.01 and 0.9 < cost["grad_cosine"] < 1 and 0 < cost["grad_rel_error"] < 0.5
    assert "v_old_fp8 vs fp32 v_old" in r.stderr + r.stdout
    assert "vs_fp32" not in cost  # fp32 compute: the compute-dtype pass is the fp32 reference

    # fp16 compute (autocast on the CPU too): both v_old passes also against fp32 arithmetic over
    # the same weights; fp16's own rounding is the smaller of the two
    r = hpcnft("bench", "--shapes", "tiny", "--no-default", "--phases", "train", "--own-shapes", "--json", out,
               "--set", "perf.v_old_fp8=true", "--set", "train.precision=fp16", env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    cost = json.loads(out.read_text())["stacks"]["hpcnft_fast"]["v_old_fp8_cost"]
    ref = cost["vs_fp32"]
    assert set(ref) == {"fp8", "fp16"}
    assert 0 < ref["fp16"]["v_old_rel_error"] < ref["fp8"]["v_old_rel_error"] < 0.05
    assert 0 < ref["fp16"]["grad_rel_error"] < ref["fp8"]["grad_rel_error"] < 0.5
    assert 0.9 < ref["fp8"]["grad_cosine"] <= ref["fp16"]["grad_cosine"] <= 1

    r = hpcnft("bench", "--shapes", "tiny", "--phases", "rollout,decode", env={"CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert r.returncode == 2 and "unknown phase decode" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.slow
def test_bench_variant_measures_fast_with_one_change_in_the_same_process(tmp_path):
    out = tmp_path / "bench.json"
    r = hpcnft("bench", "--shapes", "tiny", "--no-default", "--phases", "train,iteration", "--own-shapes",
               "--variant", "old_pass_batch=4", "--json", out, env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert not doc["errors"] and set(doc["stacks"]) == {"hpcnft_fast"}, doc
    (variant,) = doc["variants"]
    assert variant["variant"] == "perf.old_pass_batch=4"
    assert variant["config"]["overrides"]["perf.old_pass_batch"] == 4
    fast = doc["stacks"]["hpcnft_fast"]["config"]["overrides"]
    assert fast["perf.old_pass_batch"] == 8  # FAST's at the tiny shapes
    assert {k: v for k, v in variant["config"]["overrides"].items() if k != "perf.old_pass_batch"} == \
        {k: v for k, v in fast.items() if k != "perf.old_pass_batch"}
    assert set(variant["phases"]) == set(doc["stacks"]["hpcnft_fast"]["phases"]) == {"train_pair_mb8", "iteration"}
    for ph in variant["phases"].values():
        assert ph["speedup_vs_fast"] > 0
    assert "hpcnft fast with one change" in r.stdout and "perf.old_pass_batch=4" in r.stdout

    r = hpcnft("bench", "--shapes", "tiny", "--variant", "old_pass_batch", env={"CUDA_VISIBLE_DEVICES": ""},
               timeout=120)
    assert r.returncode == 2 and "--variant 'old_pass_batch': expected KEY=VALUE" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    r = hpcnft("bench", "--shapes", "tiny", "--variant", "all", env={"CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert r.returncode == 2 and "--variant 'all': expected KEY=VALUE" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_bench_reward_terms_times_every_term_per_image(tmp_path):
    from hpcnft.bench.shapes import tiny_shapes
    from hpcnft.bench.terms import TERMS

    out = tmp_path / "bench.json"
    r = hpcnft("bench", "--shapes", "tiny", "--no-default", "--phases", "reward_terms", "--json", out,
               env={"CUDA_VISIBLE_DEVICES": ""}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert not doc["errors"] and not doc["skipped"], doc
    fast = doc["stacks"]["hpcnft_fast"]
    assert set(doc["stacks"]) == {"hpcnft_fast"} and set(fast["phases"]) == set(TERMS)
    for kind in TERMS:
        m = fast["phases"][kind]
        assert m["unit"] == "image" and m["per"] == tiny_shapes().samples, (kind, m)
        assert math.isfinite(m["per_unit_s"]) and m["per_unit_s"] > 0, (kind, m)
        assert m["per_unit_s"] == pytest.approx(m["s"] / m["per"]), (kind, m)
        assert f"| {kind} | " in r.stdout
    for kind in ("hpsv2", "clipscore", "aesthetic"):  # the CLIP towers' FLOPs and MFU, as PickScore's
        m, towers = fast["phases"][kind], fast["reward_term_towers"][kind]
        assert m["flops"] > 0 and 0 < m["mfu"] < 1, (kind, m)
        assert towers["vision_params"] > 0 and towers["text_params"] > 0 and towers["dtype"] == "fp32", towers
    assert fast["reward_term_towers"]["aesthetic"]["head_params"] > 0
    assert not fast["phases"]["jpeg"].get("flops")  # no model: nothing to count


@pytest.mark.slow
def test_bench_tiny_measures_flow_grpo_beside_nft_in_one_process(tmp_path):
    """`--algo nft,flow_grpo`: the fast stack's train pairs and iteration for both algorithms, in
    one process; Flow-GRPO's at its SD3.5-M recipe's CFG, KL and updates, without NFT's levers."""
    from hpcnft.algo.registry import spec_of

    out = tmp_path / "bench.json"
    r = hpcnft("bench", "--shapes", "tiny", "--algo", "nft,flow_grpo", "--no-default", "--phases", "train,iteration",
               "--json", out, "--set", "rollout.samples_per_prompt=6", env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert not doc["errors"] and not doc["skipped"], doc
    stacks = doc["stacks"]
    assert {k: set(v["phases"]) for k, v in stacks.items()} == {
        "hpcnft_fast": {"train_pair_mb8", "iteration"}, "hpcnft_fast_flow_grpo": {"train_pair_mb8", "iteration"}}
    grpo = stacks["hpcnft_fast_flow_grpo"]
    over = grpo["config"]["overrides"]
    assert over["algo.name"] == "flow_grpo" and over["rollout.guidance_scale"] == 4.5 and over["grpo.kl_beta"] == 0.01
    assert not set(spec_of("flow_grpo").refused_levers) & set(over) and over["perf.merge_lora_nograd"] is True
    assert grpo["phases"]["train_pair_mb8"]["flops"] > 0 and grpo["phases"]["train_pair_mb8"]["per_unit_s"] > 0
    met = grpo["phases"]["iteration"]["metrics"]
    assert met["perf/iteration_s"] > 0 and met["train/kl_loss"] >= 0 and met["train/grpo_num_timesteps"] == 9
    assert "train/nft_loss" in stacks["hpcnft_fast"]["phases"]["iteration"]["metrics"]
    assert "flow_grpo time / nft time, fast" in r.stdout and "| iteration |" in r.stdout
    # --set's sample count is the shapes' too (a bench beside a job at the job's settings): the
    # iteration's per-sample accounting follows it
    for stack in stacks.values():
        assert stack["phases"]["iteration"]["samples"] == 2 * 6 and stack["phases"]["iteration"]["pairs"] == 12 * 9


def test_bench_algo_names_are_the_registry_s():
    from hpcnft.algo.registry import ALGORITHMS
    from hpcnft.bench.command import ALGOS

    assert ALGOS == tuple(ALGORITHMS)


@pytest.mark.parametrize("args, said", [(["--algo", "grpo"], "unknown algorithm grpo"),
                                        (["--algo", "flow_grpo", "--baseline"], "add nft to --algo")])
def test_bench_bad_algo_is_one_line_usage_error(args, said):
    r = hpcnft("bench", "--shapes", "tiny", *args, env={"CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert r.returncode == 2 and said in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
