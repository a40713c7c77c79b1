"""perf.base_fp8_storage (hpcnft.perf.fp8_storage): a frozen linear stored in e4m3 with row
scales gives the products and input gradients of its widened weight, within e4m3's rounding of
the loaded one; a LoRA iteration trains the adapters over the stored base; what it is refused beside."""
from __future__ import annotations

import pytest
import torch

from hpcnft.algo.root_config import load_config
from hpcnft.common.errors import ConfigError
from hpcnft.perf import fp8_storage
from hpcnft.perf.config import BASE_WEIGHT_LEVERS


def frozen_block(dtype=torch.float16) -> torch.nn.Module:
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.GELU(), torch.nn.Linear(48, 32)).to(dtype)
    return block.requires_grad_(False)


@pytest.mark.parametrize("autocast", [None, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_a_stored_linear_gives_the_products_and_input_gradients_of_its_widened_weight(autocast):
    stored = frozen_block(torch.float32 if autocast is None else autocast)
    before, after = fp8_storage.store_in_fp8([stored])
    assert all(type(m) is fp8_storage.Fp8StoredLinear and m.weight.dtype == torch.float8_e4m3fn
               for m in (stored[0], stored[2]))
    weights = 64 * 48 + 48 * 32
    assert after == weights + 4 * (48 + 32) and before == weights * stored[0].bias.element_size()
    plain = frozen_block(stored[0].bias.dtype)
    for p, s in zip((plain[0], plain[2]), (stored[0], stored[2])):
        p.weight.copy_(fp8_storage.widen(s.weight, s.weight_scale, p.weight.dtype))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    outs, grads = [], []
    for block in (stored, plain):
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            y = block(xi)
        y.float().square().sum().backward()
        outs.append(y)
        grads.append(xi.grad)
    assert outs[0].dtype == outs[1].dtype and torch.equal(outs[0], outs[1])
    assert torch.equal(grads[0], grads[1])


def test_the_stored_weight_is_the_loaded_one_within_e4m3s_rounding():
    loaded = frozen_block(torch.float32)
    stored = frozen_block(torch.float32)
    fp8_storage.store_in_fp8([stored])
    for a, b in ((loaded[0], stored[0]), (loaded[2], stored[2])):
        w = fp8_storage.widen(b.weight, b.weight_scale, torch.float32)
        # 3 mantissa bits: half a unit in the last place is 2^-4 of a normal value; e4m3's smallest
        # subnormal step is 2^-9 of the scale
        assert ((w - a.weight).abs() <= a.weight.abs() * 2**-4 + b.weight_scale * 2**-10).all()
        assert not torch.equal(w, a.weight)


def test_only_the_frozen_linears_but_the_modulation_are_stored():
    from hpcnft.perf.fp8_storage import stored_linears

    block = torch.nn.Module()
    block.norm1 = torch.nn.Module()
    block.norm1.linear = torch.nn.Linear(16, 96)  # AdaLayerNorm's modulation: one row per sample
    block.norm = torch.nn.Module()
    block.norm.linear = torch.nn.Linear(16, 48)  # FLUX's single blocks name theirs so
    block.proj = torch.nn.Linear(16, 16)
    block.trained = torch.nn.Linear(16, 16)
    block.requires_grad_(False)
    block.trained.requires_grad_(True)
    assert stored_linears([block]) == [block.proj]


@pytest.mark.parametrize("lever", BASE_WEIGHT_LEVERS)
def test_levers_that_read_the_base_in_half_precision_are_refused_beside_it(lever):
    with pytest.raises(ConfigError, match=f"perf.base_fp8_storage: not with perf.{lever}"):
        load_config("tiny", ["perf.base_fp8_storage=true", f"perf.{lever}=true"])


def test_a_full_fine_tune_is_refused():
    with pytest.raises(ConfigError, match="perf.base_fp8_storage: stores the frozen base of a LoRA run"):
        load_config("tiny", ["perf.base_fp8_storage=true", 'train.finetune="full"'])


def test_a_lora_iteration_trains_the_adapters_over_the_stored_base(hpcnft_cache):
    """The tiny iteration under FSDP2 (one rank: its groups hold e4m3, fp16 and fp32 parameters)."""
    from hpcnft.bench.shapes import _MESH, tiny_shapes
    from hpcnft.bench.stack import HpcnftStack
    from hpcnft.common.tensors import local_shard

    stack = HpcnftStack("t", "t", tiny_shapes(), torch.device("cpu"),
                        {"perf.base_fp8_storage": True, "rollout.batch_size": 4})
    try:
        from torch.distributed.fsdp import FSDPModule

        blocks = list(stack.policy.transformer.transformer_blocks)
        assert all(isinstance(b, FSDPModule) for b in blocks)
        stored = [m for b in blocks for m in b.modules() if type(m) is fp8_storage.Fp8StoredLinear]
        assert stored and all(local_shard(m.weight).dtype == torch.float8_e4m3fn for m in stored)
        base = [local_shard(m.weight).clone() for m in stored]
        adapters = [local_shard(p).detach().clone() for p in stack.policy.trainable]
        stack.iteration()[0]()
        assert all(torch.equal(local_shard(m.weight), b) for m, b in zip(stored, base))
        assert any(not torch.equal(local_shard(p), a) for p, a in zip(stack.policy.trainable, adapters))
        assert torch.isfinite(torch.tensor(stack.last_metrics["train/nft_loss"]))
    finally:
        stack.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        _MESH.clear()


def test_the_bench_measures_what_the_stored_base_costs_against_the_same_weights(hpcnft_cache):
    """`hpcnft bench`'s base_fp8_storage_cost: nothing for a base not stored (the same weights both
    ways), within e4m3's rounding for a stored one; after an iteration has trained the adapters
    and moved the old policy, it still compares the bases alone."""
    from hpcnft.bench.shapes import _MESH, tiny_shapes
    from hpcnft.bench.stack import HpcnftStack

    costs = {}
    try:
        for stored in (False, True):
            stack = HpcnftStack("t", "t", tiny_shapes(), torch.device("cpu"), {"perf.base_fp8_storage": stored})
            costs[stored] = stack.base_fp8_storage_cost(2)
            if not stored:
                old = [s.clone() for s in stack.policy.shadow]
                stack.iteration()[0]()
                assert any(not torch.equal(s, o) for s, o in zip(stack.policy.shadow, old))
                costs["trained"] = stack.base_fp8_storage_cost(2)
            stack.close()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        _MESH.clear()
    assert costs[False]["velocity_rel_error"] == 0 and costs[False]["latent_rel_error"] == 0
    assert costs["trained"]["velocity_rel_error"] == 0 and costs["trained"]["latent_rel_error"] == 0
    assert 0 < costs[True]["velocity_rel_error"] < 2**-4 and 0 < costs[True]["latent_rel_error"] < 2**-4
