"""hpcnft.algo.virtual_shards: the batches of a layout-invariant step never cross a virtual
shard and are the same whatever the number of train ranks; the shards' gradients are summed in
shard order; the config refuses what the mode cannot do."""
from __future__ import annotations

import pytest
import torch

from hpcnft.algo.root_config import ConfigError, load_config
from hpcnft.algo.virtual_shards import (ShardGradients, eval_parts, ordered_sum, pair_slices, rollout_parts,
                                        split_by_shard)
from hpcnft.distributed.config import check_layout


def test_a_ranks_samples_are_cut_at_the_shard_boundaries():
    assert split_by_shard([4, 5, 6, 7, 8, 9], 4) == [[4, 5, 6, 7], [8, 9]]
    assert split_by_shard([6, 7, 8, 9], 3) == [[6, 7, 8], [9]]


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_the_sampling_batches_of_all_ranks_together_do_not_depend_on_the_ranks(ranks):
    samples, size, batch = 32, 4, 3  # 8 shards of 4, batches of at most 3 inside each
    per = samples // ranks
    every = [part for r in range(ranks) for part in rollout_parts(list(range(r * per, (r + 1) * per)), size, batch)]
    assert every == [[s, s + 1, s + 2] if k == 0 else [s + 3] for s in range(0, 32, 4) for k in (0, 1)]


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_the_evaluation_chunks_are_the_global_lists_whatever_the_ranks(ranks):
    parts = [eval_parts(10, 4, r, ranks) for r in range(ranks)]
    assert len({len(p) for p in parts}) == 1  # lockstep: as many chunks on every rank
    real = [c for p in parts for c in p if any(i >= 0 for i in c)]
    assert real == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, -1, -1]]
    assert all(c == [-1] * 4 for p in parts for c in p if c not in real)


def test_a_shards_pairs_are_one_slice_of_the_sample_major_pairs():
    sample_ids = [8, 9, 10, 11]  # a rank's samples: shards of 2 -> shards 4 and 5
    pairs = [(pos, j) for pos in range(4) for j in (0, 3)]
    assert pair_slices(pairs, sample_ids, 2) == [(0, 4), (4, 8)]


def test_the_sum_is_taken_in_shard_order():
    rows = torch.tensor([[1e8], [1.0], [-1e8], [1.0]], dtype=torch.float32)
    assert ordered_sum(rows).item() == 1.0  # float32: 1e8 + 1 rounds to 1e8, then - 1e8 + 1
    assert ordered_sum(rows[[2, 0, 1, 3]]).item() == 2.0  # another order, other bits: why the order is fixed


def test_one_ranks_shards_gradients_summed_set_the_parameters_gradients():
    a, b = torch.zeros(2, 2, requires_grad=True), torch.zeros(3, requires_grad=True)
    bank = ShardGradients([a, b], None)
    for k in (1.0, 2.0):
        (k * (a.sum() + 2 * b.sum())).backward()
        bank.take(torch.tensor([k, 10 * k]))
        assert a.grad is None and b.grad is None  # cleared for the next shard
    sums = bank.sum_into_grads(torch.device("cpu"))
    assert a.grad.tolist() == [[3.0, 3.0], [3.0, 3.0]] and b.grad.tolist() == [6.0, 6.0, 6.0]
    assert sums.tolist() == [3.0, 30.0]


@pytest.mark.parametrize("over,match", [
    (["train.finetune=full", "train.lora_targets=[]"], "needs train.finetune"),
    (["determinism.virtual_shards=5"], "do not split the step's 16 samples"),
])
def test_what_layout_invariance_cannot_do_is_refused_naming_the_key(over, match):
    with pytest.raises(ConfigError, match=f"determinism.(layout_invariant|virtual_shards).*{match}"):
        load_config("tiny", ["determinism.layout_invariant=true", *over])


def test_an_algorithm_whose_trainer_sums_no_shards_is_refused(monkeypatch):
    """Every algorithm today sums them; a new one says so in its spec, or is refused."""
    from hpcnft.algo.nft.spec import SPEC

    monkeypatch.setattr(SPEC, "sums_virtual_shards", False)
    with pytest.raises(ConfigError, match="DiffusionNFT's trainer does not sum virtual shards"):
        load_config("tiny", ["determinism.layout_invariant=true"])


def test_train_ranks_that_do_not_divide_the_shards_are_refused_before_any_rank_starts():
    cfg = load_config("tiny", ["determinism.layout_invariant=true", "determinism.virtual_shards=4"])
    check_layout(cfg, 5)  # 4 train ranks
    with pytest.raises(ConfigError, match="determinism.virtual_shards: 4 shards do not split evenly over 8"):
        check_layout(cfg, 9)
