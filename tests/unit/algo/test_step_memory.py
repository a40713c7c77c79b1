"""A train step's memory is bounded by the micro-batch, not by the step's samples: the trainer
runs forward and backward one micro-batch at a time (the gradient accumulates), so only one
micro-batch's activations are alive at once. What grows with the step is what it keeps for
each pair until the optimizer step (docs/determinism.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SIZE = 256  # 32 x 32 latents: 256 image tokens, activations of several MiB a micro-batch
LATENT_BYTES = 16 * (SIZE // 8) ** 2 * 4  # one float32 latent: 16 channels at 1/8 of the image
SIGMAS_PER_SAMPLE = 9  # the tiny recipe's K: 10 rollout steps x 0.99
# On the CPU in fp32 a step keeps, for every pair: its sample's x0 (gathered per pair), its
# corruption noise, x_sigma and v_old. The rollout tensors themselves exist before the step.
KEPT_PER_PAIR = 4 * LATENT_BYTES


def kept(samples: int) -> int:
    return samples * SIGMAS_PER_SAMPLE * KEPT_PER_PAIR


@pytest.fixture(scope="module")
def peaks():
    """{(samples, micro_batch): growth of the peak resident set during one step}, measured in a
    process of its own (tests/step_memory.py)."""
    tool = os.path.join(os.path.dirname(__file__), "..", "..", "step_memory.py")
    r = subprocess.run([sys.executable, tool, str(SIZE), "8:8", "16:8", "8:16"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return {(c["samples"], c["micro_batch"]): c["peak_growth"] for c in json.loads(r.stdout)}


def activations(peaks, samples: int, micro_batch: int) -> int:
    """The step's peak beyond what it keeps per pair: the live micro-batch's activations."""
    return peaks[samples, micro_batch] - kept(samples)


def test_the_measurement_sees_a_micro_batchs_activations(peaks):
    one = activations(peaks, 8, 8)
    assert one > 4 * 2**20, peaks  # a micro-batch of 8 pairs at 256 px: several MiB
    assert activations(peaks, 8, 16) > 1.5 * one, peaks  # twice the micro-batch, about twice the activations


def test_twice_the_samples_add_only_what_the_step_keeps_per_pair(peaks):
    """Without accumulation 72 more pairs' activations (about nine micro-batches' worth) would be
    alive at the peak; with it the activations stay those of one micro-batch."""
    one = activations(peaks, 8, 8)
    assert abs(activations(peaks, 16, 8) - one) < 0.5 * one, peaks
