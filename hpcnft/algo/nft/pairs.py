"""The (sample, sigma) pairs a train step learns from: the batch of a rank's rollout samples,
one micro-batch's inputs, which sigmas each sample trains on, and their corruption noise."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hpcnft.algo.nft import formulas as nft
from hpcnft.algo.root_config import Config
from hpcnft.common.determinism import stable_hash


@dataclass
class PairBatch:
    """The pairs (sample, sigma) this rank trains on in one step, sample-major."""
    x0: torch.Tensor  # [n_samples, C, H, W] float32
    prompt_embeds: torch.Tensor  # [n_samples, L, D]
    pooled: torch.Tensor  # [n_samples, D]
    adv: torch.Tensor  # [n_samples] float64
    r: torch.Tensor  # [n_samples] float64
    sample_ids: list[int]  # global ids (stable across layouts) used to seed sigma order and noise
    n_global_pairs: int  # pairs of the whole optimizer step over all train ranks


@dataclass
class MicroBatch:
    """One micro-batch's pairs, ready on the train device before any forward runs: every tensor
    a forward or the loss reads is made here, so the step copies nothing host-to-device (each such
    copy would wait for the GPU to drain) between micro-batches."""
    pos: torch.Tensor  # local sample positions, on the host (host metric sums)
    index: torch.Tensor  # the same, on the device of the rollout tensors (their gathers)
    sigma: torch.Tensor  # [m] float32, train device
    x0: torch.Tensor
    x_sigma: torch.Tensor
    r: torch.Tensor  # [m] float64, train device


def train_sigma_pairs(cfg: Config, sample_ids: list[int], step: int) -> list[tuple[int, int]]:
    """(local sample position, sigma grid index) for every pair, sample-major."""
    out = []
    for pos, sid in enumerate(sample_ids):
        idx = nft.trained_sigma_indices(cfg.rollout.num_steps, cfg.trained_steps,
                                        cfg.nft.timestep_strategy, cfg.nft.shuffle_timesteps, cfg.train.seed,
                                        stable_hash(step, sid))
        out += [(pos, j) for j in idx]
    return out


def pair_noise(cfg: Config, step: int, sid: int, sigma_index: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(stable_hash("nft_corrupt", cfg.train.seed, step, sid, sigma_index))
    return torch.randn(shape, generator=g, dtype=torch.float32)


class PairNoise:
    """The corruption noise of a step's pairs, drawn on the host from per-pair generators (so it
    does not depend on the layout). `prefetch` draws it in a worker thread, into pinned memory,
    while the rollout keeps the GPU busy (drawing it at the start of the train step left the GPU
    idle ~0.2 s an iteration at the real shapes); `take` returns it, or draws it now when nothing
    was prefetched for this step and these samples. Same values either way."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self._pending = None  # (step, sample ids, shape, future)
        self._pool = None

    def draw(self, step: int, sample_ids: list[int], pairs: list[tuple[int, int]], shape: tuple,
             pin: bool = False) -> torch.Tensor:
        eps = torch.stack([pair_noise(self.cfg, step, sample_ids[p], j, shape) for p, j in pairs])
        return eps.pin_memory() if pin else eps

    def prefetch(self, step: int, sample_ids: list[int], shape: tuple, pin: bool) -> None:
        from concurrent.futures import ThreadPoolExecutor

        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpcnft-noise")
        ids, shape = list(sample_ids), tuple(shape)
        pairs = train_sigma_pairs(self.cfg, ids, step)
        self._pending = (step, ids, shape, self._pool.submit(self.draw, step, ids, pairs, shape, pin))

    def take(self, step: int, sample_ids: list[int], pairs: list[tuple[int, int]], shape: tuple) -> torch.Tensor:
        pending, self._pending = self._pending, None
        if pending is not None and pending[:3] == (step, list(sample_ids), tuple(shape)):
            return pending[3].result()  # re-raises the worker's exception here
        return self.draw(step, list(sample_ids), pairs, tuple(shape))
