"""hpcnft.common.determinism and the per-sample noise of hpcnft.algo.sampler
(docs/architecture.md, "Contracts the code keeps")."""
from __future__ import annotations

import hashlib
import os
import pickle
import random

import numpy as np
import pytest
import torch

from hpcnft.algo.sampler import initial_noise
from hpcnft.common.determinism import capture_rng_state, restore_rng_state, stable_hash

MASK63 = (1 << 63) - 1


def test_stable_hash_is_blake2b_64_of_the_colon_joined_parts_masked_to_63_bits():
    # By hand: blake2b(b"nft_sigma_shuffle:1234:5", digest_size=8) = 62 8d cf 16 f9 72 0f 09,
    # read little-endian = 0x090f72f916cf8d62, top bit clear -> 652866885147135330.
    digest = hashlib.blake2b(b"nft_sigma_shuffle:1234:5", digest_size=8).digest()
    assert digest.hex() == "628dcf16f9720f09"
    assert int.from_bytes(digest, "little") & MASK63 == 0x090F72F916CF8D62 == 652866885147135330
    assert stable_hash("nft_sigma_shuffle", 1234, 5) == 652866885147135330
    # a second one whose top bit is set, so the mask matters: ad 89 72 56 3e e2 67 4c -> 0x4c67...
    digest = hashlib.blake2b(b"rollout_noise:42:1:7", digest_size=8).digest()
    assert stable_hash("rollout_noise", 42, 1, 7) == int.from_bytes(digest, "little") & MASK63


def test_stable_hash_is_a_valid_seed():
    values = [stable_hash("p", i) for i in range(2000)]
    assert all(0 <= v < 2 ** 63 for v in values)
    assert max(values) >= 2 ** 62  # uses the 63 bits (the top of the range is reached)
    assert len(set(values)) == len(values)
    # (not Python's salted hash(): the value pinned in the test above holds in every process)


def test_stable_hash_depends_on_part_order():
    assert stable_hash("a", 1, 2) != stable_hash("a", 2, 1)
    assert stable_hash("x", 1) != stable_hash(1, "x")
    assert stable_hash("a", 1, 2) == stable_hash("a", 1, 2)


def _draw():
    return (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist())


def test_capture_restore_rng_round_trip():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draw()
    blob = capture_rng_state()
    assert isinstance(blob, bytes)
    first = _draw()
    _draw()  # move every stream on
    restore_rng_state(blob)
    assert _draw() == first
    restore_rng_state(blob)  # a blob can be restored twice
    assert _draw() == first


class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_safe_unpickler_refuses_foreign_callables_without_running_them(tmp_path):
    marker = tmp_path / "pwned"
    state = pickle.loads(capture_rng_state())  # a genuine state, with a payload slipped in
    state["python"] = _Evil(str(marker))
    blob = pickle.dumps(state, protocol=4)
    with pytest.raises(pickle.UnpicklingError, match="system"):
        restore_rng_state(blob)
    assert not marker.exists()
    # a bare payload too
    with pytest.raises(pickle.UnpicklingError):
        restore_rng_state(pickle.dumps(_Evil(str(marker))))
    assert not marker.exists()


def test_safe_unpickler_refuses_builtins_eval():
    class _Eval:
        def __reduce__(self):
            return (eval, ("1+1",))

    with pytest.raises(pickle.UnpicklingError):
        restore_rng_state(pickle.dumps({"python": _Eval()}))


def test_initial_noise_does_not_depend_on_the_batch():
    shape = (16, 8, 8)
    alone = initial_noise(shape, 42, 3, [5], "rollout_noise")
    batched = initial_noise(shape, 42, 3, [3, 5, 7], "rollout_noise")
    assert alone.shape == (1, *shape) and batched.shape == (3, *shape)
    assert alone.dtype == torch.float32
    assert torch.equal(alone[0], batched[1])
    assert torch.equal(initial_noise(shape, 42, 3, [7, 3], "rollout_noise")[0], batched[2])
    # and it is keyed by index, step, seed and purpose
    assert not torch.equal(batched[0], batched[1])
    assert not torch.equal(alone[0], initial_noise(shape, 42, 4, [5], "rollout_noise")[0])
    assert not torch.equal(alone[0], initial_noise(shape, 43, 3, [5], "rollout_noise")[0])
    assert not torch.equal(alone[0], initial_noise(shape, 42, 3, [5], "eval_noise")[0])


def test_noise_drawn_ahead_in_a_worker_is_the_initial_noise_of_each_chunk(thread_spy):
    from hpcnft.algo import sampler
    from hpcnft.algo.sampler import NoiseAhead

    real = sampler.initial_noise
    threads = thread_spy(sampler, "initial_noise")
    shape, parts = (4, 8, 8), [[0, 1, 2], [3, 4], [7]]
    futures = NoiseAhead().draw(shape, 42, 3, parts, "rollout_noise")
    for chunk, fut in zip(parts, futures):
        assert torch.equal(fut.result(), real(shape, 42, 3, chunk, "rollout_noise"))
    assert len(threads) == 3 and all(t.startswith("hpcnft-noise-ahead") for t in threads)


def test_initial_noise_ignores_the_global_rng():
    torch.manual_seed(0)
    a = initial_noise((4,), 1, 1, [0, 1], "p")
    torch.manual_seed(999)
    torch.rand(10)
    assert torch.equal(a, initial_noise((4,), 1, 1, [0, 1], "p"))
