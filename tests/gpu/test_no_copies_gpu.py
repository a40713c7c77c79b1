"""On a CUDA device: the sampler's steps and the train step's micro-batches copy nothing from the
host (a copy from pageable host memory waits for the GPU to drain, so the CPU could no longer
queue work ahead of it). Counted as the CUDA runtime's memcpy calls launched inside each part,
against those of a bare DiT forward (and backward) with every input already on the device."""
from __future__ import annotations

import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from hpcnft.algo.sampler import Conditioning, euler_sample, velocity
from hpcnft.bench.shapes import SHAPES
from hpcnft.bench.stack import HpcnftStack

DEV = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def stack():
    s = HpcnftStack("t", "tiny", SHAPES["tiny"](), DEV, {"perf.skip_single_rank_fsdp": True})
    yield s
    s.close()


def _profiled(fn):
    fn()  # once untimed: nothing lazily made on the first call is counted
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return prof.events()


def _memcpys(events, inside: str | None = None) -> int:
    """Runtime memcpy calls (host side), all of them or those inside the named ranges."""
    calls = [e for e in events if e.device_type == DeviceType.CPU and "memcpy" in e.name.lower()
             and "aten" not in e.name]
    if inside is None:
        return len(calls)
    ranges = [e.time_range for e in events if e.name == inside and e.device_type == DeviceType.CPU]
    assert ranges, f"no range {inside}"
    return sum(any(r.start <= c.time_range.start <= r.end for r in ranges) for c in calls)


def _device_inputs(stack, n: int):
    x = stack._latent(n).to(DEV)
    pe, pooled = (t.to(DEV) for t in stack._cond(n))
    return x, pe, pooled


def _bare_forward(stack, n: int, grad: bool):
    policy = stack.policy
    x, pe, pooled = _device_inputs(stack, n)
    s = torch.full((n,), 0.5, device=DEV)

    def fn():
        with torch.set_grad_enabled(grad), policy.autocast():
            v = velocity(policy.transformer, x, s, pe, pooled, policy.compute_dtype)
        if grad:
            (v.float() * v.float()).mean().backward()  # not square(): its backward copies to the device
    return fn


def test_the_sampler_copies_its_sigmas_once_not_per_step(stack):
    policy, n = stack.policy, 2
    per_forward = _memcpys(_profiled(_bare_forward(stack, n, grad=False)))
    x, pe, pooled = _device_inputs(stack, n)
    for steps in (2, 6):
        sigmas = torch.linspace(1.0, 0.0, steps + 1)  # on the host, as sigma_grid gives them
        events = _profiled(lambda: euler_sample(policy.transformer, x, sigmas, Conditioning(pe, pooled), 1.0,
                                                policy.compute_dtype, policy.autocast))
        assert _memcpys(events) == 1 + steps * per_forward, steps


def test_a_micro_batch_copies_nothing_from_the_host(stack):
    mb = 2
    per_pass = _memcpys(_profiled(_bare_forward(stack, mb, grad=True)))
    fn, ctx, _ = stack.train_pairs(mb)
    with ctx():
        events = _profiled(fn)
    n_micro = sum(e.name == "hpcnft/train/micro_batch" and e.device_type == DeviceType.CPU for e in events)
    assert n_micro == 2
    assert _memcpys(events, inside="hpcnft/train/micro_batch") == n_micro * per_pass
    assert _memcpys(events, inside="hpcnft/train/inputs") > 0  # the inputs are made before, on purpose
