"""MixGRPO's rollout sampler: the ODE's Euler step outside the window, Flow-GRPO's SDE transition
(hpcnft.algo.sde_policy.sde_step) inside it, recording the window's states and transitions'
log-probabilities, as the authors' run_sample_step with Flow-GRPO's sampling (its deterministic
step is the Euler step x + dt v). The window's noise is drawn on the host per sample
(hpcnft.algo.sampler.initial_noise), so it does not depend on which rank or batch makes it."""
from __future__ import annotations

import torch

from hpcnft.algo.sampler import Conditioning, guided_velocity
from hpcnft.algo.sde_policy import sde_step

SDE_NOISE = "rollout_window_noise"  # the draws' purpose (initial_noise)


@torch.no_grad()
def mixed_sample(transformer, noise: torch.Tensor, sde_noise: torch.Tensor, sigmas: torch.Tensor,
                 cond: Conditioning, guidance_scale: float, dtype: torch.dtype, autocast, noise_level: float,
                 window: list[int], integer_timesteps: bool = False):
    """Sample from `noise` [B, C, h, w] over `sigmas` (terminal 0 included), the steps of `window`
    (consecutive) with the SDE, window step j adding sde_noise[:, j] ([B, len(window), C, h, w]).
    Returns (the final latent, the window's states [B, len(window) + 1, C, h, w] (the state
    before its first step, then after each; the final latent alone for an empty window), their
    transitions' log-probabilities [B, len(window)]), float32."""
    x = noise.float()
    sigmas = sigmas.to(x.device)  # once: a host-to-device copy per step would wait for the GPU each time
    sigma_max = sigmas[1].item()  # the SDE's std at sigma = 1 uses the grid's second value, as the authors'
    states, log_probs = [], []
    for k in range(len(sigmas) - 1):
        v = guided_velocity(transformer, x, sigmas[k], cond, guidance_scale, dtype, autocast, integer_timesteps)
        if k in window:
            states = states or [x]
            x, log_prob, _, _ = sde_step(x, v, sigmas[k], sigmas[k + 1], sigma_max, noise_level,
                                         noise=sde_noise[:, window.index(k)])
            states.append(x)
            log_probs.append(log_prob)
        else:
            x = x + (sigmas[k + 1] - sigmas[k]) * v
    states = states or [x]
    kept = torch.stack(log_probs, dim=1) if log_probs else x.new_zeros(x.shape[0], 0)
    return x, torch.stack(states, dim=1), kept
