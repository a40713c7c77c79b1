"""perf.gelu_epilogue on the CPU: the feed-forward's linear + GELU as one op
(torch._addmm_activation), only in the no-grad passes and only where the op's GELU is the
module's, and a context that leaves the model as it found it. On the CPU the op's GELU is the
exact one, so the tiny DiT's GELUs are made exact here to take it; SD3's tanh GELU takes it on
CUDA (tests/gpu/test_epilogue_gpu.py)."""
import pytest
import torch
import torch.nn.functional as F

from hpcnft.perf import epilogue, fp8, levers
from lora_tools import RecordOps, tiny_policy, tiny_velocity


def _exact_gelu_policy(**perf):
    policy = tiny_policy(**perf)
    for m in epilogue.gelu_modules(policy.transformer):
        m.approximate = "none"
    return policy


@pytest.mark.parametrize("autocast", [False, True])
def test_addmm_gelu_is_the_linear_then_the_devices_gelu_in_the_linears_dtype(autocast):
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 5, 32, generator=g), torch.randn(48, 32, generator=g) / 6, torch.randn(48, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = epilogue.addmm_gelu(x, w, b)
        ref = F.gelu(F.linear(x, w, b), approximate=epilogue.OP_GELU["cpu"])
    assert y.dtype == ref.dtype and y.shape == ref.shape == (2, 5, 48)
    torch.testing.assert_close(y, ref, rtol=1e-2 if autocast else 1e-5, atol=1e-2 if autocast else 1e-6)


def test_no_grad_passes_use_the_epilogue_and_the_model_is_left_as_it_was():
    policy = _exact_gelu_policy(merge_lora_nograd=True, fuse_qkv=True, gelu_epilogue=True)
    tr = policy.transformer
    classes = [type(m) for m in tr.modules()]
    with RecordOps() as outside:
        before = tiny_velocity(policy)
    with levers.nograd_weights(policy):
        gelus = epilogue.gelu_modules(tr)
        assert gelus and all(isinstance(m, epilogue.EpilogueGELUMixin) for m in gelus)
        with RecordOps() as inside:
            merged = tiny_velocity(policy)
        with fp8.blocks_in_fp8(tr), RecordOps() as in_fp8:  # an fp8 first linear: diffusers' forward
            tiny_velocity(policy)
    assert "aten::_addmm_activation" in inside.names and "aten::gelu" not in inside.names
    assert "aten::_addmm_activation" not in outside.names + in_fp8.names and "aten::gelu" in in_fp8.names
    assert [type(m) for m in tr.modules()] == classes
    torch.testing.assert_close(merged, before, rtol=1e-4, atol=1e-5)
    assert torch.equal(tiny_velocity(policy), before)


def test_only_where_the_ops_gelu_is_the_modules():
    policy = tiny_policy(merge_lora_nograd=True, gelu_epilogue=True)  # SD3's tanh GELU; the CPU op's is exact
    with levers.nograd_weights(policy), RecordOps() as ops:
        assert all(isinstance(m, epilogue.EpilogueGELUMixin) for m in epilogue.gelu_modules(policy.transformer))
        tiny_velocity(policy)
    assert "aten::_addmm_activation" not in ops.names and "aten::gelu" in ops.names


def test_off_by_default_and_never_where_gradients_flow():
    policy = _exact_gelu_policy(merge_lora_nograd=True)
    with levers.nograd_weights(policy):
        assert not any(isinstance(m, epilogue.EpilogueGELUMixin) for m in policy.transformer.modules())
    module = epilogue.gelu_modules(policy.transformer)[0]
    x = torch.randn(2, 3, module.proj.in_features, requires_grad=True)
    with epilogue.feed_forwards(policy.transformer):
        assert isinstance(module, epilogue.EpilogueGELUMixin)
        with RecordOps() as ops:
            y = module(x)  # the op has no backward: diffusers' forward where x needs a gradient
        y.sum().backward()
        with torch.no_grad(), RecordOps() as nograd:
            module(x)
    assert x.grad is not None and "aten::_addmm_activation" not in ops.names
    assert "aten::_addmm_activation" in nograd.names
    assert not isinstance(module, epilogue.EpilogueGELUMixin)


def test_flops_are_counted_as_the_gemms():
    from torch.utils.flop_counter import FlopCounterMode

    x, w, b = torch.randn(2, 5, 32), torch.randn(48, 32), torch.randn(48)
    with FlopCounterMode(display=False) as fused:
        epilogue.addmm_gelu(x, w, b)
    with FlopCounterMode(display=False) as plain:
        F.gelu(F.linear(x, w, b))
    assert fused.get_total_flops() == plain.get_total_flops() == 2 * 10 * 32 * 48
