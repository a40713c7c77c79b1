"""perf.rollout_fp8 on the CPU (torch._scaled_mm runs there too): row-wise e4m3 quantization,
the fp8 linear against F.linear, the tiny DiT's rollout forward in fp8 against its fp32 forward,
and a context that leaves the model as it found it."""

import pytest
import torch
import torch.nn.functional as F

from hpcnft.algo.root_config import load_config
from hpcnft.perf import fp8, fused_qkv, levers
from lora_tools import RecordOps, move_adapters, tiny_lora_dit, tiny_policy, tiny_velocity


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_rows_quantize_to_their_own_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 1e3, 0.5, 2.0])[:, None]
    x[4] = 0.0  # an all-zero row stays zero (no division by zero)
    q, scale = fp8.quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, 1)
    back = q.float() * scale
    assert torch.equal(back[4], torch.zeros(64))
    amax = x.abs().amax(dim=1)
    assert torch.allclose(q.float().abs().amax(dim=1)[amax > 0], torch.tensor(fp8.E4M3_MAX))  # full range used
    # e4m3: 3 mantissa bits, so at most half an ulp (2^-4 relative) per element of a row's range
    err = (back - x).abs() / torch.where(x.abs() > 0, x.abs(), torch.ones(1))
    assert float(err[x.abs() > amax[:, None] / 64].max()) <= 2.0 ** -4 + 1e-6


@pytest.mark.parametrize("autocast", [False, True])
def test_scaled_linear_is_close_to_the_linear_and_keeps_its_dtype(autocast):
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(2, 7, 64, generator=g), torch.randn(48, 64, generator=g) / 8, torch.randn(48, generator=g)
    wq, ws = fp8.quantize_rows(w)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y, ref = fp8.scaled_linear(x, wq, ws, b), F.linear(x, w, b)
    assert y.dtype == ref.dtype and y.shape == ref.shape
    assert 0 < _rel(y, ref) < 0.05


@pytest.mark.parametrize("fuse", [False, True])
def test_fp8_rollout_forward_is_close_and_leaves_the_model_as_it_was(fuse):
    policy = tiny_policy(merge_lora_nograd=True, fuse_qkv=fuse)
    tr = policy.transformer
    before = tiny_velocity(policy)
    state = {k: v.clone() for k, v in tr.state_dict().items()}
    with levers.nograd_weights(policy):
        merged = tiny_velocity(policy)
        procs = [m.processor for m in tr.modules() if hasattr(m, "processor")]
        with fp8.blocks_in_fp8(tr) as n:
            kinds = {type(m) for m in tr.transformer_blocks.modules()}
            in_fp8 = tiny_velocity(policy)
            fused = [m for m in tr.modules() if isinstance(getattr(m, "processor", None), fp8.Fp8FusedQKVProcessor)]
        assert [m.processor for m in tr.modules() if hasattr(m, "processor")] == procs
        assert torch.equal(tiny_velocity(policy), merged)  # the merged forward again, bit for bit
    assert fp8.Fp8Linear in kinds and n > 0
    assert bool(fused) == fuse  # the fused q/k/v GEMMs go fp8 too
    # the modulation linears (one row per sample) stay in full precision
    assert all(type(blk.norm1.linear) is torch.nn.Linear for blk in tr.transformer_blocks)
    assert 0 < _rel(in_fp8, merged) < 0.05
    assert not any(isinstance(m, fp8.Fp8Linear) for m in tr.modules())
    assert torch.equal(tiny_velocity(policy), before)
    after = tr.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)  # no fp8 buffer saved


def test_fp8_weights_follow_the_weights_at_entry():
    policy = tiny_policy(merge_lora_nograd=True, fuse_qkv=True)
    with levers.nograd_weights(policy), fp8.blocks_in_fp8(policy.transformer):
        first = tiny_velocity(policy)
    move_adapters(policy.transformer)
    with levers.nograd_weights(policy):
        merged = tiny_velocity(policy)
        with fp8.blocks_in_fp8(policy.transformer):
            second = tiny_velocity(policy)
    assert _rel(second, merged) < 0.25 * _rel(first, merged)  # quantized from the new weights


def test_fp8_only_where_scaled_mm_can_multiply():
    assert fp8.supported(torch.empty(48, 64)) and not fp8.supported(torch.empty(40, 64))
    tr = tiny_lora_dit(load_config("tiny", ["train.lora_rank=16"]))  # A and B of a shape fp8 could take
    names = {n for n, m in tr.transformer_blocks.named_modules() if m in fp8.block_linears(tr)}
    assert names and not any("norm" in n or "lora_" in n for n in names)
    assert {"0.ff.net.2", "0.attn.to_out.0.base_layer", "0.ff_context.net.0.proj", "0.attn2.to_q"} <= names
    assert fused_qkv.FusedQKVProcessor not in {type(getattr(m, "processor", None)) for m in tr.modules()}


def test_weights_of_one_shape_quantize_together_as_each_alone():
    g = torch.Generator().manual_seed(3)
    mods = [torch.nn.Linear(32, 48), torch.nn.Linear(32, 48), torch.nn.Linear(48, 32)]
    for m in mods:
        m.weight.data = torch.randn(m.weight.shape, generator=g) * (1 + 10 * torch.rand(m.weight.shape[0], 1, generator=g))
    entries = [(mods[0], mods[0].weight, ""), (mods[1], mods[1].weight, "added_"), (mods[2], mods[2].weight, "")]
    fp8.quantize_into(entries)
    for m, w, prefix in entries:
        q, scale = fp8.quantize_rows(w)
        assert torch.equal(getattr(m, prefix + fp8.WEIGHT).view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(getattr(m, prefix + fp8.SCALE), scale)
    buffers = [getattr(m, prefix + fp8.WEIGHT) for m, _, prefix in entries]
    for m in mods:
        m.weight.data.mul_(-2.0)
    fp8.quantize_into(entries)  # the next entry: in place, new values
    for (m, w, prefix), buf in zip(entries, buffers):
        assert getattr(m, prefix + fp8.WEIGHT) is buf
        assert torch.equal(buf.view(torch.uint8), fp8.quantize_rows(w)[0].view(torch.uint8))


def test_feed_forwards_quantize_their_hidden_activation_in_one_op():
    policy = tiny_policy(merge_lora_nograd=True, fuse_qkv=True)
    tr = policy.transformer
    ff = tr.transformer_blocks[0].ff
    x = torch.randn(2, 9, ff.net[0].proj.in_features, generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), levers.nograd_weights(policy):
        with fp8.blocks_in_fp8(tr):
            ffs = [m for m in tr.modules() if isinstance(m, fp8.Fp8FeedForwardMixin)]
            with RecordOps() as ops:
                fused = ff(x)
            # the same GEMMs with diffusers' GELU between them, hidden activation in fp32
            h = F.gelu(fp8.scaled_linear(x, getattr(ff.net[0].proj, fp8.WEIGHT), getattr(ff.net[0].proj, fp8.SCALE),
                                         ff.net[0].proj.bias.float()), approximate="tanh")
            unfused = fp8.scaled_linear(h, getattr(ff.net[2], fp8.WEIGHT), getattr(ff.net[2], fp8.SCALE), ff.net[2].bias)
        plain = ff(x)
    # every block's image and text feed-forward (the last block has no text one)
    n_blocks = len(tr.transformer_blocks)
    assert len(ffs) == 2 * n_blocks - 1 and not any(isinstance(m, fp8.Fp8FeedForwardMixin) for m in tr.modules())
    assert "hpcnft::gelu_quantize_rows" in ops.names and "aten::gelu" not in ops.names
    assert [o for o in ops.names if o == "aten::_scaled_mm"] == ["aten::_scaled_mm"] * 2
    torch.testing.assert_close(fused, unfused, rtol=0, atol=1e-6)
    assert 0 < _rel(fused, plain) < 0.1  # one tiny feed-forward: e4m3's 2^-4 per input, twice


def test_gelu_quantize_rows_is_gelu_then_row_quantization():
    g = torch.Generator().manual_seed(5)
    h, b = torch.randn(5, 24, generator=g) * 3, torch.randn(24, generator=g).bfloat16().float()
    h[2] = -b  # a row that is zero after the bias
    q, scale = fp8.gelu_quantize_rows(h.bfloat16(), b)
    ref_q, ref_scale = fp8.quantize_rows(F.gelu(h.bfloat16().float() + b, approximate="tanh"))
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (5, 1)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale, ref_scale)
    assert torch.equal(q[2].float(), torch.zeros(24))
