"""What a train rank's checkpoint holds, as Stateful parts (torch.distributed.checkpoint calls
their state_dict() to save and to lay out what it loads, then load_state_dict()): the checkpointer
(hpcnft.io.checkpointer) is handed them by name and reaches into nothing. The names are the
checkpoint's top-level keys, the same since the first checkpoint format."""
from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.tensor import DTensor

from hpcnft.algo.policy import Policy
from hpcnft.io.checkpoint import LOAD_OPTIONS, MODEL_OPTIONS, CheckpointError


class TrainedWeights:
    """The DiT's trained weights (LoRA adapters, or every weight of a full fine-tune): its state
    dict without the frozen weights and the buffers, which the model folder and config give
    (SD3.5-M's position table alone is 0.9 GB)."""
    what = "the trained weights"

    def __init__(self, policy: Policy):
        self.policy = policy

    def state_dict(self) -> dict:
        model = self.policy.transformer
        state = get_model_state_dict(model, options=MODEL_OPTIONS)
        buffers = {name.replace("_orig_mod.", "") for name, _ in model.named_buffers()}
        return {k: v for k, v in state.items() if k.replace("_orig_mod.", "") not in buffers}

    def load_state_dict(self, state: dict) -> None:
        result = set_model_state_dict(self.policy.transformer, state, options=LOAD_OPTIONS)
        trained = set(self.policy.trainable_names)
        missing = [k for k in result.missing_keys if k in trained]
        if missing or result.unexpected_keys:
            raise CheckpointError(f"{self.what} do not match the model (missing {missing[:3]}, "
                                  f"unexpected {list(result.unexpected_keys)[:3]})")


class Shadow:
    """A copy of the trained weights the policy keeps beside them (pi_old's EMA, the evaluation
    EMA), as DTensors laid out like the live parameters."""

    def __init__(self, policy: Policy, tensors: list[torch.Tensor], what: str):
        self.policy, self.tensors, self.what = policy, tensors, what

    def state_dict(self) -> dict:
        p = self.policy
        return {name: (DTensor.from_local(s, w.device_mesh, w.placements, shape=w.shape, stride=w.stride())
                       if isinstance(w, DTensor) else s)
                for name, w, s in zip(p.trainable_names, p.trainable, self.tensors)}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for s, loaded in zip(self.tensors, state.values()):
                s.copy_(loaded.to_local() if isinstance(loaded, DTensor) else loaded)


class OptimizerState:
    """AdamW's moments and step counts of the trained weights."""
    what = "the optimizer's state"

    def __init__(self, policy: Policy, optimizer: torch.optim.Optimizer):
        self.policy, self.optimizer = policy, optimizer

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.policy.transformer, self.optimizer, options=MODEL_OPTIONS)

    def load_state_dict(self, state: dict) -> None:
        set_optimizer_state_dict(self.policy.transformer, self.optimizer, state, options=MODEL_OPTIONS)


def checkpoint_parts(policy: Policy, optimizer: torch.optim.Optimizer) -> dict:
    """A train rank's parts by their checkpoint names; the evaluation EMA where eval.policy = "ema"
    (a key a resume cannot change)."""
    parts = {"model": TrainedWeights(policy), "old_policy": Shadow(policy, policy.shadow, "pi_old (the old policy)"),
             "optim": OptimizerState(policy, optimizer)}
    if policy.eval_shadow is not None:
        parts["eval_ema"] = Shadow(policy, policy.eval_shadow, "the evaluation EMA of theta")
    return parts
