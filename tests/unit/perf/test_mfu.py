"""The FLOP count of the perf metrics and the bench: FlopCounterMode's total, in the memory of
the work it counts. FlopCounterMode's per-module tracking holds on to each checkpointed block's
recomputed tensors until the count ends, so a counted backward grows by a block's activations
per block; the count here does not."""
import gc

import torch
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from hpcnft.perf.mfu import FlopCount

ROWS, WIDTH = 4096, 4096  # a block's hidden activation: 64 MiB in fp32


def _resident_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def _growth_over_a_checkpointed_backward(counter) -> float:
    """How far the resident memory rises (MiB) between the first and last block of the backward,
    without the cycle collector (which a GPU's memory does not prompt)."""
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(256, WIDTH), torch.nn.GELU(), torch.nn.Linear(WIDTH, 256))
              for _ in range(5)]
    seen = []
    gc.collect()
    gc.disable()
    try:
        with counter:
            h, outs = torch.randn(ROWS, 256, requires_grad=True), []
            for block in blocks:
                h = checkpoint(block, h, use_reentrant=False)
                outs.append(h)
            for out in outs[:-1]:  # each fires once the blocks after it are through their backward
                out.register_hook(lambda grad: seen.append(_resident_bytes()))
            h.square().mean().backward()
    finally:
        gc.enable()
    return (max(seen) - seen[0]) / 2**20


def _measure() -> tuple[float, float, int, int]:
    plain, ours = FlopCounterMode(display=False), FlopCount()
    grown = _growth_over_a_checkpointed_backward(plain), _growth_over_a_checkpointed_backward(ours)
    return (*grown, ours.total, plain.get_total_flops())


def test_the_count_is_flopcountermodes_and_keeps_no_checkpointed_block_alive():
    """Measured in a fresh interpreter: memory another test freed in this one would be reused
    without raising the resident size, and hide the growth."""
    import multiprocessing

    block_mib = ROWS * WIDTH * 4 / 2**20
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        plain, ours, total, plain_total = pool.apply(_measure)
    assert plain > 2 * block_mib
    assert ours < block_mib
    assert total == plain_total > 0
