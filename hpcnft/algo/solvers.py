"""The rollout's ODE solvers by name (rollout.solver)."""
from __future__ import annotations

import torch

from hpcnft.algo.dpm_solver import dpm2_sample
from hpcnft.algo.sampler import Conditioning, euler_sample

# one sampler per name of rollout.solver's choices, hpcnft.algo.config.SOLVERS (a test holds the two)
SOLVERS = {"euler": euler_sample, "dpm2": dpm2_sample}


def sample(solver: str, transformer, noise: torch.Tensor, sigmas: torch.Tensor, cond: Conditioning,
           guidance_scale: float, dtype: torch.dtype, autocast, integer_timesteps: bool = False) -> torch.Tensor:
    """The final latent (float32) of the deterministic ODE sampler `solver`: "euler" or "dpm2"."""
    return SOLVERS[solver](transformer, noise, sigmas, cond, guidance_scale, dtype, autocast, integer_timesteps)
