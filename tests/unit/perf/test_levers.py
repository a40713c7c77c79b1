"""The perf levers of hpcnft.perf on the CPU with the tiny shapes: what each promises about the
numerics (bit for bit, or close), and the guards (deterministic mode, dispatch modes)."""
import dataclasses

import pytest
import torch

from hpcnft.bench.shapes import _MESH, tiny_shapes
from hpcnft.bench.stack import HpcnftStack
from hpcnft.common.tensors import module_list
from hpcnft.perf import compiling, levers, lora_merge
from lora_tools import RecordOps


@pytest.fixture
def stacks():
    made = []

    def make(over=None):
        s = HpcnftStack("t", "t", tiny_shapes(), torch.device("cpu"), dict(over or {}))
        made.append(s)
        return s
    yield make
    for s in made:
        s.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _MESH.clear()


def _train_metrics(stack, seed_b: bool = True):
    fn, ctx, _ = stack.train_pairs(4)
    if seed_b:  # peft starts B at zero: give the adapters something to merge
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for layer in levers.lora_layers(stack.policy.transformer):
                w = layer.lora_B["default"].weight
                w = w.to_local() if hasattr(w, "to_local") else w
                w.copy_(torch.randn(w.shape, generator=g) * 0.02)
        stack.policy.shadow = [p.detach().clone() if not hasattr(p, "to_local") else p.to_local().detach().clone()
                               for p in stack.policy.trainable]
    with ctx():
        fn()
    return stack.last_metrics


def test_v_old_fp8_multiplies_the_v_old_pass_in_fp8_and_nothing_else(stacks):
    """With pi_old == pi_theta (one step from the same weights) the positive and negative
    branches agree bit for bit; with v_old in fp8 they differ by its rounding, and every fp8
    GEMM of the step ran without grad (the trained forward and its backward keep fp32)."""
    runs = {}
    for on in (False, True):
        s = stacks({"perf.skip_single_rank_fsdp": True, "perf.v_old_fp8": on})
        with RecordOps() as ops:
            metrics = _train_metrics(s)
        runs[on] = metrics, [g for name, g in zip(ops.names, ops.grad) if name == "aten::_scaled_mm"]
    (plain, plain_fp8_ops), (fp8_m, fp8_ops) = runs[False], runs[True]
    assert plain_fp8_ops == [] and fp8_ops and not any(fp8_ops)
    assert plain["train/nft_pos_loss"] == plain["train/nft_neg_loss"]
    assert fp8_m["train/nft_pos_loss"] != fp8_m["train/nft_neg_loss"]
    for key in ("train/nft_pos_loss", "train/nft_neg_loss", "train/nft_loss", "train/grad_norm"):
        assert fp8_m[key] == pytest.approx(plain[key], rel=0.05), key


def test_skip_single_rank_fsdp_is_bit_for_bit(stacks):
    a = _train_metrics(stacks())
    b = _train_metrics(stacks({"perf.skip_single_rank_fsdp": True}))
    assert a == b


def test_merged_lora_matches_and_restores_the_base_bitwise(stacks):
    s = stacks({"perf.skip_single_rank_fsdp": True})
    _train_metrics(s)  # seeds B and takes one step
    policy = s.policy
    x = torch.randn(4, 16, 8, 8)
    sig = s.sigmas[2].expand(4)
    pe, pooled = s._cond(4)
    from hpcnft.algo.sampler import velocity

    base = {n: p.detach().clone() for n, p in policy.transformer.named_parameters() if not p.requires_grad}
    with torch.no_grad(), policy.old_weights():
        unmerged = velocity(policy.transformer, x, sig, pe, pooled, torch.float32)
    policy.cfg.perf.merge_lora_nograd = True
    with torch.no_grad(), policy.old_weights():
        # adapters off inside, by their flag; the trainable set is left as it is
        assert all(layer.disable_adapters for layer in levers.lora_layers(policy.transformer))
        assert all(p.requires_grad for p in policy.trainable)
        merged = velocity(policy.transformer, x, sig, pe, pooled, torch.float32)
    assert not any(layer.disable_adapters for layer in levers.lora_layers(policy.transformer))
    assert all(p.requires_grad for p in policy.trainable)
    after = {n: p.detach() for n, p in policy.transformer.named_parameters() if n in base}
    assert all(torch.equal(base[n], after[n]) for n in base)
    torch.testing.assert_close(merged, unmerged, rtol=1e-4, atol=1e-5)


def test_module_lists_are_found_once_per_model():
    calls = []

    def find(root):
        calls.append(root)
        return [m for m in root.modules() if isinstance(m, torch.nn.Linear)]
    a, b = torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    first = module_list(a, "linears", find)
    assert module_list(a, "linears", find) is first and calls == [a]
    assert module_list(b, "linears", find) == [b[0]] and calls == [a, b]  # kept per model
    assert "linears" not in dict(a.named_modules()) and not list(a.state_dict().keys() - {"0.weight", "0.bias"})


def test_batched_old_pass_matches_per_micro_batch(stacks):
    a = _train_metrics(stacks({"perf.skip_single_rank_fsdp": True}))
    b = _train_metrics(stacks({"perf.skip_single_rank_fsdp": True, "perf.old_pass_batch": 8}))
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-9), k


def test_deterministic_mode_turns_off_compile_and_the_attention_backend():
    from hpcnft.algo.root_config import Config

    cfg = Config()
    cfg.perf = dataclasses.replace(cfg.perf, compile_blocks=True, attention_backend="flash", merge_lora_nograd=True)
    cfg.determinism.enabled = True
    eff = levers.effective(cfg)
    assert not eff.compile_blocks and eff.attention_backend == "default" and eff.merge_lora_nograd
    cfg.determinism.enabled = False
    assert levers.effective(cfg).compile_blocks


@pytest.mark.parametrize("key,option", [("inductor_tuning", "coordinate_descent_tuning"),
                                        ("inductor_autotune", "max_autotune_pointwise")])
def test_inductor_tuning_is_set_for_what_compiles_next_and_off_in_deterministic_mode(key, option):
    import torch._inductor.config as inductor
    from hpcnft.algo.root_config import Config

    cfg = Config()
    cfg.determinism.enabled = False
    saved = {o: getattr(inductor, o) for o in ("coordinate_descent_tuning", "max_autotune_pointwise")}
    try:
        for on in (True, False):
            cfg.perf = dataclasses.replace(cfg.perf, **{key: on})
            compiling.inductor_options(levers.effective(cfg))
            assert getattr(inductor, option) is on
            assert not any(getattr(inductor, o) for o in saved if o != option)  # the other lever stays off
        cfg.perf, cfg.determinism.enabled = dataclasses.replace(cfg.perf, **{key: True}), True
        assert not getattr(levers.effective(cfg), key)
    finally:
        for o, v in saved.items():
            setattr(inductor, o, v)


def test_compiled_blocks_step_aside_under_a_dispatch_mode():
    """FlopCounterMode around a compiled block would make dynamo skip its code for good."""
    from torch.utils.flop_counter import FlopCounterMode

    call = compiling._CompiledCall(lambda x: ("eager", x), lambda x: ("compiled", x))
    assert call(1) == ("compiled", 1)
    with FlopCounterMode(display=False):
        assert call(1) == ("eager", 1)
    assert call(2) == ("compiled", 2)


@pytest.mark.parametrize("precision,cast", [("bf16", False), ("fp32", True)])
def test_half_precision_policy_skips_peft_input_casts(stacks, precision, cast):
    policy = stacks({"train.precision": precision, "perf.skip_single_rank_fsdp": True}).policy
    layers = levers.lora_layers(policy.transformer)
    assert layers and all(getattr(layer, "cast_input_dtype_enabled", True) is cast for layer in layers)


def test_the_fast_recipe_is_the_reference_recipe_with_FAST():
    from hpcnft.algo.root_config import load_config
    from hpcnft.common.validation import flatten

    ref = flatten(load_config("sd35m_pickscore").to_dict())
    fast_recipe = flatten(load_config("sd35m_pickscore_fast").to_dict())
    changed = {k: v for k, v in fast_recipe.items() if ref[k] != v}
    assert changed == {k: v for k, v in levers.FAST.items() if ref[k] != v}


@pytest.mark.parametrize("one_scale", [True, False])
def test_stacked_merge_gives_each_layer_its_own_merged_weight(one_scale):
    import copy

    from lora_tools import tiny_policy

    policy = tiny_policy(merge_lora_nograd=True)
    tr = policy.transformer
    layers = levers.lora_layers(tr)
    if not one_scale:  # adapters of other alphas: a scale per layer
        for i, layer in enumerate(layers):
            layer.scaling["default"] *= 1.0 + 0.5 * i
    reference = copy.deepcopy(tr)
    with torch.no_grad():
        for layer in levers.lora_layers(reference):
            lora_merge._merge_one(layer)
    want = [layer.get_base_layer().weight.detach().clone() for layer in levers.lora_layers(reference)]
    before = [layer.get_base_layer().weight.detach().clone() for layer in layers]
    assert all(lora_merge._plain_adapter(layer) == "default" for layer in layers)
    assert len(lora_merge._merge_groups([(layer, "default") for layer in layers], most=4)) > 1  # groups split at `most`
    with levers.merged_lora(policy):
        for layer, w, b in zip(layers, want, before):
            got = layer.get_base_layer().weight
            torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-7)
            assert not torch.equal(got, b)  # the adapters moved it
    assert all(torch.equal(layer.get_base_layer().weight, b) for layer, b in zip(layers, before))


def test_a_layer_with_a_transposed_lora_is_merged_on_its_own():
    from lora_tools import tiny_policy

    policy = tiny_policy(merge_lora_nograd=True)
    layers = levers.lora_layers(policy.transformer)
    odd = layers[0]
    odd.fan_in_fan_out = True  # peft's Conv1D layout: delta transposed (square here)
    assert lora_merge._plain_adapter(odd) is None and lora_merge._plain_adapter(layers[1]) == "default"
    w = odd.get_base_layer().weight
    before = w.detach().clone()
    a, b = odd.lora_A["default"].weight.float(), odd.lora_B["default"].weight.float()
    with levers.merged_lora(policy):
        want = (before.float() + (b @ a).T * odd.scaling["default"]).to(before.dtype)
        assert torch.equal(w, want)
    assert torch.equal(w, before)
