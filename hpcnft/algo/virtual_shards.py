"""determinism.layout_invariant: a step's work cut into fixed virtual shards, so that its results
do not depend on how many train ranks share it.

A step's samples split into `determinism.virtual_shards` contiguous shards of equal size; a train
rank owns a contiguous block of them (the train ranks divide the shards). Every batch the work
is done in stays inside one shard: the rollout's sampling batches, the training micro-batches
(`train.micro_batch` pairs of the shard's pairs), the evaluation's chunks (cut from the global
prompt list). So each shard's images, losses and gradient are the same bits whichever rank makes
them. The shards' gradients are then gathered on every train rank and summed in shard order
(`ShardGradients`), and the optimizer steps on the whole sum, which every rank holds alike: no
reduction whose order follows the number of ranks is left. The trained parameters (LoRA) stay
whole on every rank for that (hpcnft.algo.policy leaves them out of FSDP2).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


def shard_size(n_samples: int, shards: int) -> int:
    return n_samples // shards


def split_by_shard(samples: list[int], size: int) -> list[list[int]]:
    """A rank's contiguous samples (global indices) cut at the shard boundaries."""
    out: list[list[int]] = []
    for s in samples:
        if not out or s // size != out[-1][-1] // size:
            out.append([])
        out[-1].append(s)
    return out


def rollout_parts(samples: list[int], size: int, batch: int) -> list[list[int]]:
    """The sampling batches of a rank's samples: at most `batch` each, never across a shard."""
    return [shard[i:i + batch] for shard in split_by_shard(samples, size) for i in range(0, len(shard), batch)]


def eval_parts(n_prompts: int, size: int, train_index: int, n_train: int) -> list[list[int]]:
    """A rank's evaluation chunks: the global prompt list cut into chunks of `size` (the last
    padded with -1, "compute and discard"), a contiguous block of them per rank, every rank given
    as many chunks (whole chunks of -1: FSDP2's forwards run in lockstep)."""
    ids = list(range(n_prompts))
    chunks = [ids[i:i + size] for i in range(0, n_prompts, size)]
    chunks[-1] += [-1] * (size - len(chunks[-1]))
    per = math.ceil(len(chunks) / n_train)
    mine = chunks[train_index * per:(train_index + 1) * per]
    return mine + [[-1] * size for _ in range(per - len(mine))]


def pair_slices(pairs: list[tuple[int, int]], sample_ids: list[int], size: int) -> list[tuple[int, int]]:
    """(start, end) in `pairs` (local sample position, sigma index; sample-major) of each shard's
    pairs, in order."""
    out: list[tuple[int, int]] = []
    for i, (pos, _) in enumerate(pairs):
        shard = sample_ids[pos] // size
        if not out or shard != out[-1][2]:
            out.append((i, i + 1, shard))
        else:
            out[-1] = (out[-1][0], i + 1, shard)
    return [(lo, hi) for lo, hi, _ in out]


def ordered_sum(rows: torch.Tensor) -> torch.Tensor:
    """rows[0] + rows[1] + ... in that order (not a reduction kernel's, whose order may follow
    the shape or the device)."""
    total = rows[0].clone()
    for row in rows[1:]:
        total += row
    return total


def sum_over_shards(rows: torch.Tensor, group, comm_device: torch.device) -> torch.Tensor:
    """Every train rank's `rows` (one per shard of its own, in order) gathered in rank order, which
    is shard order, and summed in that order; on `comm_device` (where the group's collectives take
    their tensors)."""
    local = rows.to(comm_device).contiguous()
    if group is not None:
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local, group=group)
        local = torch.cat(parts)
    return ordered_sum(local)


class ShardGradients:
    """The step's gradient from its shards: `take()` after each of this rank's shards' backwards
    keeps the shard's gradient (flattened) and clears it; `sum_into_grads()` gathers every train
    rank's shards (in rank order, which is shard order), sums them in shard order and sets the
    parameters' gradients to the sum. `take(sums)` keeps the shard's metric sums beside it, which
    `sum_into_grads` returns summed so too."""

    def __init__(self, params: list[torch.Tensor], group):
        self.params, self.group = params, group
        self.grads: list[torch.Tensor] = []
        self.sums: list[torch.Tensor] = []

    def take(self, sums: torch.Tensor | None = None) -> None:
        flat = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
                for p in self.params]
        self.grads.append(torch.cat(flat))
        if sums is not None:
            self.sums.append(sums.to(torch.float64))
        for p in self.params:
            p.grad = None

    def sum_into_grads(self, comm_device: torch.device) -> torch.Tensor | None:
        """Set the parameters' gradients to the sum of every shard's; returns the shards' metric
        sums, summed in shard order (on the host; None where none were taken). `comm_device`:
        where the group's collectives take their tensors."""
        grads = sum_over_shards(torch.stack(self.grads), self.group, comm_device)
        sums = sum_over_shards(torch.stack(self.sums), self.group, comm_device).cpu() if self.sums else None
        offset = 0
        for p in self.params:
            p.grad = grads[offset:offset + p.numel()].view_as(p).to(p.device, copy=True)
            offset += p.numel()
        self.grads, self.sums = [], []
        return sums
