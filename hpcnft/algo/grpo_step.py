"""Flow-GRPO's part of an iteration; hpcnft.algo.iteration's Learner runs the rest (the rollout's
chunks, decoding and rewards, the gather, the EMA update, the evaluation). What is Flow-GRPO's:
the rollout samples with the SDE (hpcnft.algo.grpo_sampler) and keeps each sample's first K + 1
states and the log-probabilities of its first K transitions, and CFG's empty-prompt conditioning;
the advantages are per prompt text (hpcnft.algo.grpo.group_advantages) and go to the clipped
objective as they are; the trainer (hpcnft.algo.grpo_trainer) makes grpo.updates_per_step
updates; and the rollout policy is theta itself: pi_old is set to theta after every step (decay 0),
so the rollout, the evaluation of pi_old and `hpcnft export --policy old` see theta."""
from __future__ import annotations

import torch

from hpcnft.algo import grpo
from hpcnft.algo.grpo_sampler import SDE_NOISE, sde_sample
from hpcnft.algo.grpo_trainer import GRPOBatch, GRPOTrainer
from hpcnft.algo.sampler import NoiseAhead
from hpcnft.io.runfile import GRPO_TRAIN_KEYS


class GRPOStep:
    name = "flow_grpo"
    metric_keys = GRPO_TRAIN_KEYS  # run.h5 keys beyond hpcnft.io.runfile.ALL_KEYS

    def __init__(self, cfg):
        self.cfg = cfg
        self.noise_ahead = NoiseAhead()
        self._sde_noise: list = []  # the transitions' noise of the rollout's chunks still to sample (futures)

    def make_trainer(self, policy, group, num_train_ranks: int) -> GRPOTrainer:
        return GRPOTrainer(self.cfg, policy, group, num_train_ranks)

    def trained_steps(self) -> int:
        return grpo.num_trained_steps(self.cfg.rollout.num_steps, self.cfg.grpo.timestep_fraction)

    def pair_flops(self, flops) -> float:
        """The DiT work of one train pair: the trained forward and backward (both CFG halves),
        and the KL reference's forward."""
        passes = 2 if self.cfg.rollout.guidance_scale > 1.0 else 1
        fwd_bwd = flops.train_pair - flops.rollout_forward
        return passes * (fwd_bwd + (flops.rollout_forward if self.cfg.grpo.kl_beta > 0 else 0.0))

    def begin_rollout(self, learner, step: int, parts: list[list[int]]) -> None:
        """Every chunk's transition noise, drawn on the host by a worker thread while the GPU samples."""
        shape = (self.cfg.rollout.num_steps, *learner.latent_shape)
        self._sde_noise = self.noise_ahead.draw(shape, self.cfg.rollout.seed, step, parts, SDE_NOISE,
                                                pin=learner.topo.device.type == "cuda")

    def sample(self, learner, prompts: list[str], noise: torch.Tensor, chunk: list[int], step: int):
        """(final latents, conditioning, (states, log-probabilities, CFG's empty-prompt conditioning or None))."""
        cfg, policy, dev = self.cfg, learner.policy, learner.topo.device
        cond = learner.encoder(prompts)
        sde = self._sde_noise.pop(0).result()
        k = self.trained_steps()
        x0, states, log_probs = sde_sample(policy.transformer, noise.to(dev, non_blocking=noise.is_pinned()),
                                           sde.to(dev, non_blocking=sde.is_pinned()), learner.sigmas, cond,
                                           cfg.rollout.guidance_scale, policy.compute_dtype, policy.autocast,
                                           cfg.grpo.noise_level, k)
        neg = None if cond.neg_prompt_embeds is None else (cond.neg_prompt_embeds[:1], cond.neg_pooled[:1])
        return x0, cond, (states, log_probs[:, :k], neg)

    def train_batch(self, learner, step: int, ro, rewards: torch.Tensor, mine: range) -> GRPOBatch:
        adv = grpo.group_advantages(rewards, learner.step_prompts(step), self.cfg.grpo.global_std)
        neg = ro.kept[0][2]
        return GRPOBatch(torch.cat([kept[0] for kept in ro.kept]), torch.cat([kept[1] for kept in ro.kept]),
                         ro.prompt_embeds, ro.pooled, neg[0] if neg else None, neg[1] if neg else None,
                         adv[mine.start:mine.stop], list(mine), self.cfg.samples_per_step)

    def old_policy_decay(self, step: int) -> float:
        return 0.0
