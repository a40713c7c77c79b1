"""What every algorithm's trainer shares: AdamW over the policy's trainable parameters, the fp16
loss scaler, micro-batching, and the optimizer step with gradient clipping (skipped, and the
scale halved, where the global gradient norm is not finite), and the evaluation EMA of theta
(eval.policy = "ema") after the optimizer steps its schedule names. The checkpoints keep the
optimizer and the scaler of whichever trainer the algorithm makes."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hpcnft.algo.policy import Policy
from hpcnft.algo.root_config import Config
from hpcnft.algo.shared_math import eval_ema_decay
from hpcnft.distributed.groups import collective_device


class LossScaler:
    """Dynamic loss scaling with torch.amp.GradScaler's rules (init S, x0.5 on overflow, x2
    after 2000 clean steps). The overflow decision comes from the global grad norm, which is
    the same on every rank of the FSDP mesh, so all ranks skip or step together."""

    def __init__(self, init_scale: float, enabled: bool, growth_interval: int = 2000):
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_interval = growth_interval
        self.growth_tracker = 0

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.scale *= 0.5
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.scale *= 2.0
                self.growth_tracker = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])


class TrainerBase:
    """An algorithm's trainer: step(batch, sigmas, step) -> the step's metrics, on every train rank."""

    def __init__(self, cfg: Config, policy: Policy, train_group, num_train_ranks: int):
        self.cfg, self.policy = cfg, policy
        self.group, self.num_train_ranks = train_group, num_train_ranks
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(policy.trainable, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                           weight_decay=o.weight_decay)
        self.scaler = LossScaler(cfg.train.grad_scaler_init, enabled=cfg.train.precision == "fp16")

    def comm_device(self) -> torch.device:
        """Where the train group's collectives take their tensors (the train device alone)."""
        if self.group is None:
            return self.policy.device
        return collective_device(dist.get_backend(self.group), self.policy.device)

    def micro_batches(self, pairs: list, size: int):
        for i in range(0, len(pairs), size):
            yield pairs[i:i + size]

    def step(self, batch, sigmas: torch.Tensor, step: int) -> dict[str, float]:
        raise NotImplementedError

    def _optimizer_step(self, update: int) -> tuple[float, bool]:
        """Clip, step (unless the gradient norm is not finite), then the evaluation EMA's turn.
        `update`: the run's optimizer steps so far, this one included."""
        params = self.policy.trainable
        if self.scaler.enabled:
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(1.0 / self.scaler.scale)
        norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.optim.grad_clip)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        grad_norm = float(norm.item())
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            self.optimizer.step()
        self.scaler.update(found_inf=skipped)
        self.optimizer.zero_grad(set_to_none=True)
        e = self.cfg.eval
        if e.policy == "ema" and (update + 1) % e.ema_update_every == 0:  # EMAModuleWrapper's schedule
            self.policy.eval_ema_update(eval_ema_decay(update, e.ema_decay))
        return grad_norm, skipped
