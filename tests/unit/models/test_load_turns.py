"""The train ranks of one host taking turns while their base transformer is in fp32 in host
memory (hpcnft.models.load_turns, layout.stagger_loads)."""
from __future__ import annotations

import threading
import time

import pytest

from hpcnft.models.load_turns import load_turn, read_bytes, turns_needed

GIB = 2**30


@pytest.mark.parametrize("setting,per_rank,ranks,available,take", [
    ("auto", 44 * GIB, 2, 120 * GIB, False),  # 88 GiB of 120: under 80 %
    ("auto", 48 * GIB, 2, 110 * GIB, True),  # 96 GiB of 110: over
    ("auto", 48 * GIB, 1, 50 * GIB, False),  # one rank on the host: nobody to wait for
    ("always", 1, 2, 100 * GIB, True),
    ("always", 1, 1, 100 * GIB, False),
    ("never", 48 * GIB, 4, 64 * GIB, False),
])
def test_turns_are_taken_where_all_at_once_would_not_fit(setting, per_rank, ranks, available, take):
    assert turns_needed(setting, per_rank, ranks, available) is take


def test_a_turn_waits_for_the_one_before_it_on_the_same_run_dir(tmp_path):
    run_dir, order = str(tmp_path / "run"), []

    def rank(name: str, hold: float) -> None:
        with load_turn(run_dir, True):
            order.append(f"{name} in")
            time.sleep(hold)
            order.append(f"{name} out")

    first = threading.Thread(target=rank, args=("a", 0.5))
    first.start()
    time.sleep(0.1)
    second = threading.Thread(target=rank, args=("b", 0.0))
    second.start()
    first.join()
    second.join()
    assert order == ["a in", "a out", "b in", "b out"]
    with load_turn(str(tmp_path / "other"), True), load_turn(str(tmp_path / "third"), True):
        pass  # other runs on the host have turns of their own


def test_the_size_at_a_dtype_is_read_from_the_headers(tiny_models):
    import torch
    from diffusers import SD3Transformer2DModel

    dit = SD3Transformer2DModel.from_pretrained(f"{tiny_models[0]}/transformer")
    expected = sum(t.numel() for t in dit.state_dict().values()) * 4
    assert read_bytes(tiny_models[0]) == expected and dit.dtype == torch.float32
    assert read_bytes(tiny_models[0], 2) == expected // 2
