"""determinism.layout_invariant on the tiny recipe (gloo on the CPU): runs on 1 and 2 train
ranks, and a run of 2+1 ranks resumed as 4+1, then 1+1, then 2+2, all bit-identical to the run
straight on 2+1; without the mode the layouts differ (the reason the mode exists); Flow-GRPO on
1 and 2 train ranks alike."""
from __future__ import annotations

import pytest

from jobs import INVARIANT_ARGS as INVARIANT
from jobs import INVARIANT_STEPS as STEPS
from jobs import TINY_ARGS, TINY_STEPS, assert_same_metrics, hpcnft, non_perf
from hpcnft.io.compare import compare_metrics
from hpcnft.io.runfile import read_run

pytestmark = pytest.mark.slow


def layout(train: int, reward: int) -> tuple[str, ...]:
    return ("--set", f"layout.train_ranks={train}", "--set", f"layout.reward_ranks={reward}")


@pytest.fixture(scope="module")
def straight(invariant_run) -> str:
    """The session's run straight on 2+1 (tests/conftest.py)."""
    return invariant_run


def test_a_run_resumed_on_three_other_layouts_is_bit_identical_to_the_straight_run(straight, tmp_path):
    run_dir = str(tmp_path / "moved")
    for step, (train, reward) in enumerate([(2, 1), (4, 1), (1, 1), (2, 2)], start=1):
        hpcnft("run", "tiny", "--steps", str(step), "--run-dir", run_dir, *INVARIANT, *layout(train, reward))
    assert_same_metrics(straight, run_dir)
    assert [e["step"] for e in read_run(run_dir).events if e["kind"] == "layout"] == [1, 2, 3]


def test_one_train_rank_gives_the_bits_of_two_and_without_the_mode_it_does_not(straight, tiny_run, tmp_path):
    one = str(tmp_path / "1+1")
    hpcnft("run", "tiny", "--steps", str(STEPS), "--run-dir", one, *INVARIANT, *layout(1, 1))
    assert_same_metrics(straight, one)
    plain = str(tmp_path / "plain")  # tiny_run's command (2+1) on one train rank
    hpcnft("run", "tiny", "--steps", str(TINY_STEPS), "--run-dir", plain, *TINY_ARGS, *layout(1, 1))
    a, b = (non_perf(read_run(d).metrics) for d in (tiny_run.run_dir, plain))
    assert not compare_metrics(a, b).same  # gradients reduced in another order


@pytest.mark.parametrize("algo", ["flow_grpo"])  # MixGRPO's updates are the same code
def test_the_transition_algorithms_give_the_same_bits_on_one_and_two_train_ranks(algo, tmp_path, hpcnft_cache):
    """Flow-GRPO's (and MixGRPO's) updates sum the virtual shards too (algo/transition_trainer.py)."""
    runs = {t: str(tmp_path / f"{t}+1") for t in (1, 2)}
    for train, run_dir in runs.items():
        hpcnft("run", "tiny", "--steps", "3", "--run-dir", run_dir, *INVARIANT, "--set", f"algo.name={algo}",
               *layout(train, 1))
    assert_same_metrics(runs[2], runs[1])
