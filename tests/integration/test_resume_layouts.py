"""A run resumed onto another layout (a requeue onto what the cluster had free): the checkpoint
resharded onto more or fewer train ranks and another number of reward ranks, each change said on
the terminal and recorded as a `layout` event; the metrics within the tolerance that gradients
reduced in another order leave (docs/determinism.md), against the session's `tiny_run` (2+1)."""
from __future__ import annotations

import json

import pytest

from jobs import TINY_ARGS, copy_run, hpcnft, non_perf
from hpcnft.io.compare import compare_metrics
from hpcnft.io.runfile import read_run

# The same rollouts whatever the layout (noise keyed by global sample index); the training steps
# reduce their gradients in another order: nft_loss agrees to ~1e-8, the gradient's norm to ~1e-3.
RTOL, ATOL = 1e-3, 1e-7

pytestmark = pytest.mark.slow


def layout(train: int, reward: int) -> tuple[str, ...]:
    return ("--set", f"layout.train_ranks={train}", "--set", f"layout.reward_ranks={reward}")


@pytest.fixture(scope="module")
def moved(tiny_run, tmp_path_factory) -> dict:
    """tiny_run's run dir cut back to its first checkpoint (2+1), resumed as 4+1 for step 2, then
    as 1+1 for step 3; and cut back to its second, resumed as 2+2. The run dirs and outputs."""
    run_dir = copy_run(tiny_run, str(tmp_path_factory.mktemp("layouts") / "run"), keep_checkpoints_through=1)
    outs = [hpcnft("run", "tiny", "--steps", "2", "--run-dir", run_dir, *TINY_ARGS, *layout(4, 1)),
            hpcnft("run", "tiny", "--steps", "3", "--run-dir", run_dir, *TINY_ARGS, *layout(1, 1))]
    two_reward = copy_run(tiny_run, str(tmp_path_factory.mktemp("layouts") / "2+2"), keep_checkpoints_through=2)
    outs.append(hpcnft("run", "tiny", "--steps", "3", "--run-dir", two_reward, *TINY_ARGS, *layout(2, 2)))
    return {"run_dir": run_dir, "2+2": two_reward, "outs": outs}


def test_each_start_on_another_layout_says_so_and_records_it(moved):
    first, second, third = (o.stdout for o in moved["outs"])
    assert "hpcnft: resuming on another layout: 2 train + 1 reward ranks on 1 host(s)" in first
    assert "-> 4 train + 1 reward ranks" in first
    assert "4 train + 1 reward ranks on 1 host(s)" in second and "-> 1 train + 1 reward ranks" in second
    assert "-> 2 train + 2 reward ranks" in third
    events = [(e["step"], e["text"]) for e in read_run(moved["run_dir"]).events if e["kind"] == "layout"]
    assert [s for s, _ in events] == [1, 2]
    topo = read_run(moved["run_dir"]).topology
    assert json.loads(topo["train_ranks"]) == [0] and json.loads(topo["reward_ranks"]) == [1]


@pytest.mark.parametrize("which", ["run_dir", "2+2"])
def test_a_run_moved_across_layouts_ends_within_the_tolerance_of_the_unmoved_run(moved, tiny_run, which):
    a, b = non_perf(read_run(tiny_run.run_dir).metrics), non_perf(read_run(moved[which]).metrics)
    assert set(a) == set(b)
    result = compare_metrics(a, b, rtol=RTOL, atol=ATOL)
    assert result.same, "\n".join(str(d) for d in result.divergences)
    # the step the resume starts with samples from the checkpoint's weights: the same images
    first = 2 if which == "run_dir" else 3
    assert a["rollout/reward/raw_mean"][:first].tolist() == b["rollout/reward/raw_mean"][:first].tolist()


def test_what_a_layout_cannot_change_is_refused_before_any_rank_starts(tiny_run, tmp_path):
    run_dir = copy_run(tiny_run, str(tmp_path / "run"), keep_checkpoints_through=1)
    r = hpcnft("run", "tiny", "--steps", "3", "--run-dir", run_dir, *TINY_ARGS, *layout(4, 1),
               "--set", "rollout.prompts_per_step=8", check=False)
    assert r.returncode == 2
    assert "cannot resume" in r.stderr and "rollout.prompts_per_step (4 -> 8)" in r.stderr
