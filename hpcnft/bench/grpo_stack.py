"""Flow-GRPO's path as a bench stack, measured beside DiffusionNFT's in the same process
(`hpcnft bench --algo nft,flow_grpo`): the package's own code with algo.name = "flow_grpo" and
the values its SD3.5-M recipe (sd35m_pickscore_grpo) gives the algorithm (CFG 4.5 in the rollout
and the trained forward, the KL reference to the base, 2 updates a step), at the shapes' sizes and
with the stack's levers but DiffusionNFT's own (its v_old pass) and the fp8 rollout (which
Flow-GRPO's ratio would measure). Phases: the train pairs (GRPOTrainer.step on `mb` samples x
TRAIN_K transitions, one update) and the whole iteration (SDE rollout, decode, reward, the
updates)."""
from __future__ import annotations

import contextlib

from hpcnft.bench.shapes import TRAIN_K, _torch
from hpcnft.bench.stack import HpcnftStack

# the keys Flow-GRPO refuses (hpcnft.algo.root_config: check_algorithm), dropped from the levers
NFT_ONLY = ("perf.old_pass_batch", "perf.v_old_fp8", "perf.rollout_fp8")
GRPO = {"algo.name": "flow_grpo", "rollout.guidance_scale": 4.5, "grpo.kl_beta": 0.01, "grpo.updates_per_step": 2}


def grpo_overrides(overrides: dict, family: str) -> dict:
    out = {k: v for k, v in overrides.items() if k not in NFT_ONLY}
    out.update(GRPO)
    if family == "flux":  # FLUX.1-dev embeds its guidance: the NFT recipe's value (no CFG)
        out.pop("rollout.guidance_scale")
    return out


class GrpoStack(HpcnftStack):
    def __init__(self, key: str, label: str, S, dev, overrides: dict):
        super().__init__(key, label, S, dev, grpo_overrides(overrides, S.family))

    def _grpo_batch(self, mb: int):
        """A GRPOBatch of `mb` samples with TRAIN_K transitions each (seeded), on the device as
        Learner.rollout leaves it, with CFG's empty-prompt conditioning where the family guides so."""
        torch = _torch()
        from hpcnft.algo.flow_grpo.trainer import GRPOBatch
        from hpcnft.models.families import family_named

        self.policy
        g = torch.Generator().manual_seed(7)
        states = torch.randn(mb, TRAIN_K + 1, *self.S.latent_shape, generator=g).to(self.dev)
        old = (torch.randn(mb, TRAIN_K, generator=g) * 1e-3 - 1.0).to(self.dev)
        pe, pooled = (t.to(self.dev) for t in self._cond(mb, seed=8))
        neg = None
        if self.cfg.rollout.guidance_scale > 1.0 and family_named(self.S.family).cfg_guidance:
            neg = tuple(t[:1].to(self.dev) for t in self._cond(1, seed=9))
        adv = torch.randn(mb, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
        return GRPOBatch(states, old, pe, pooled, neg[0] if neg else None, neg[1] if neg else None, adv,
                         list(range(mb)), mb)

    def train_pairs(self, mb: int):
        """GRPOTrainer.step on `mb` samples with TRAIN_K transitions each, in one update: TRAIN_K
        micro-batches of `mb`."""
        cfg, batch = self.cfg, self._grpo_batch(mb)

        @contextlib.contextmanager
        def ctx():
            g = cfg.grpo
            saved = (g.timestep_fraction, g.updates_per_step, cfg.train.micro_batch)
            g.timestep_fraction, g.updates_per_step, cfg.train.micro_batch = TRAIN_K / cfg.rollout.num_steps, 1, mb
            try:
                yield
            finally:
                g.timestep_fraction, g.updates_per_step, cfg.train.micro_batch = saved

        def fn():
            self.step_no += 1
            self.last_metrics = self.trainer.step(batch, self.sigmas, self.step_no)
        return fn, ctx, mb * TRAIN_K
