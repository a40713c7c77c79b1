"""Flow-GRPO's rollout sampler: the SDE of hpcnft.algo.flow_grpo.formulas.sde_step over the scheduler's sigma
grid (the same grid and guidance as the ODE samplers), recording each transition's
log-probability under the sampling policy, as flow_grpo's pipeline_with_logprob does.

Its noise, the initial latent's and each transition's, is drawn on the host per sample
(hpcnft.algo.sampler.initial_noise: keyed by seed, step and global sample index), so it does not
depend on which rank or batch makes it."""
from __future__ import annotations

import torch

from hpcnft.algo.flow_grpo.formulas import sde_step
from hpcnft.algo.sampler import Conditioning, guided_velocity

SDE_NOISE = "rollout_sde_noise"  # the draws' purpose (initial_noise), beside the initial noise's "rollout_noise"


@torch.no_grad()
def sde_sample(transformer, noise: torch.Tensor, sde_noise: torch.Tensor, sigmas: torch.Tensor, cond: Conditioning,
               guidance_scale: float, dtype: torch.dtype, autocast, noise_level: float, keep: int):
    """Sample from `noise` [B, C, h, w] over `sigmas` (terminal 0 included), transition k adding
    sde_noise[:, k] ([B, T, C, h, w]). Returns (the final latent, the first keep + 1 states
    x_0 .. x_keep [B, keep + 1, C, h, w], every transition's log-probability [B, T]), float32."""
    x = noise.float()
    sigmas = sigmas.to(x.device)  # once: a host-to-device copy per step would wait for the GPU each time
    sigma_max = sigmas[1].item()  # the SDE's std at sigma = 1 uses the grid's second value, as the authors'
    states, log_probs = [x], []
    for k in range(len(sigmas) - 1):
        v = guided_velocity(transformer, x, sigmas[k], cond, guidance_scale, dtype, autocast)
        x, log_prob, _, _ = sde_step(x, v, sigmas[k], sigmas[k + 1], sigma_max, noise_level, noise=sde_noise[:, k])
        states.append(x)
        log_probs.append(log_prob)
    return x, torch.stack(states[:keep + 1], dim=1), torch.stack(log_probs, dim=1)
