"""MixGRPO's part of an iteration (hpcnft.algo.protocol): the rollout of step s follows the ODE
but for the window of step s (formulas.window), sampled with the SDE, keeping the window's states
and its transitions' log-probabilities, and CFG's empty-prompt conditioning; the advantages are
per group of a prompt's samples (formulas.group_advantages); the trainer (hpcnft.algo.mixgrpo.
trainer) makes mixgrpo.updates_per_step updates on the window's transitions; and the rollout
policy is theta itself: pi_old is set to theta after every step (decay 0)."""
from __future__ import annotations

import torch

from hpcnft.algo.mixgrpo import formulas as mix
from hpcnft.algo.mixgrpo.sampler import SDE_NOISE, mixed_sample
from hpcnft.algo.mixgrpo.spec import SPEC
from hpcnft.algo.mixgrpo.trainer import MixGRPOTrainer
from hpcnft.algo.protocol import RolloutModels, Sampled
from hpcnft.algo.sampler import NoiseAhead
from hpcnft.algo.transition_trainer import SDEBatch, synthetic_batch


class MixGRPO:
    spec = SPEC

    def __init__(self, cfg):
        self.cfg = cfg
        self.trainer: MixGRPOTrainer | None = None
        self.models: RolloutModels | None = None
        self.noise_ahead = NoiseAhead()
        self._window: list[int] = []
        self._start = 0
        self._sde_noise: list = []  # the window's noise of the rollout's chunks still to sample (futures)

    def make_trainer(self, policy, group, num_train_ranks: int) -> MixGRPOTrainer:
        self.trainer = MixGRPOTrainer(self.cfg, policy, group, num_train_ranks)
        return self.trainer

    def bind(self, models: RolloutModels) -> None:
        self.models = models

    def pair_flops(self, flops) -> float:
        """The DiT work of one train pair: the trained forward and backward (both CFG halves)."""
        passes = 2 if self.cfg.rollout.guidance_scale > 1.0 else 1
        return passes * (flops.train_pair - flops.rollout_forward)

    def begin_rollout(self, step: int, parts: list[list[int]]) -> None:
        """The step's window, and every chunk's window noise, drawn on the host by a worker thread
        while the GPU samples."""
        m, num_steps = self.cfg.mixgrpo, self.cfg.rollout.num_steps
        # where the window is (recorded even where it holds no step), then its steps
        self._start = mix.window_start(step, num_steps, m.window_every, m.window_stride, m.window_roll_back)
        self._window = mix.window_steps(self._start, num_steps, m.window_size)
        shape = (len(self._window), *self.models.latent_shape)
        self._sde_noise = self.noise_ahead.draw(shape, self.cfg.rollout.seed, step, parts, SDE_NOISE,
                                                pin=self.models.device.type == "cuda")

    def sample(self, prompts: list[str], noise: torch.Tensor, step: int) -> Sampled:
        cfg, m = self.cfg, self.models
        cond = m.encoder(prompts)
        sde = self._sde_noise.pop(0).result()
        dev = m.device
        x0, states, log_probs = mixed_sample(m.policy.transformer, noise.to(dev, non_blocking=noise.is_pinned()),
                                             sde.to(dev, non_blocking=sde.is_pinned()), m.sigmas, cond,
                                             cfg.rollout.guidance_scale, m.policy.compute_dtype, m.policy.autocast,
                                             cfg.mixgrpo.noise_level, self._window, cfg.rollout.integer_timesteps)
        neg = None if cond.neg_prompt_embeds is None else (cond.neg_prompt_embeds[:1], cond.neg_pooled[:1])
        return Sampled(x0, cond, (states, log_probs, neg))

    def train_batch(self, step: int, rollout, rewards: torch.Tensor, prompts: list[str], mine: range) -> SDEBatch:
        adv = mix.group_advantages(rewards, self.cfg.rollout.samples_per_prompt)
        neg = rollout.kept[0][2]
        return SDEBatch(torch.cat([k[0] for k in rollout.kept]), torch.cat([k[1] for k in rollout.kept]),
                        rollout.prompt_embeds, rollout.pooled, neg[0] if neg else None, neg[1] if neg else None,
                        adv[mine.start:mine.stop], list(mine), self.cfg.samples_per_step,
                        first=self._start)

    def old_policy_decay(self, step: int) -> float:
        return 0.0

    def synthetic_batch(self, n: int, k: int, cond, latent_shape, device) -> SDEBatch:
        return synthetic_batch(n, k, cond, latent_shape, device)
