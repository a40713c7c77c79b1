"""DPM-Solver++ 2M for flow matching (rollout.solver = "dpm2"): the deterministic multistep
sampler of the official DiffusionNFT SD3.5 recipe, 10 steps on the scheduler's sigma grid.

With x_sigma = (1 - sigma) x0 + sigma eps, alpha = 1 - sigma and lambda = log(alpha / sigma),
each step turns the velocity into a data prediction x0_hat = x - sigma v and moves along the
exponential integrator. The first step and the last one are first order (DDIM with eta = 0; the
last lands on x0_hat itself), the others second order from the last two data predictions. The
coefficients are computed in float64 and applied to float32 latents, as the official solver does;
NFT trains on the final latent only, so the rollout's solver does not change the train step.
"""
from __future__ import annotations

import torch

from hpcnft.algo.sampler import Conditioning, guided_velocity


def data_prediction(x: torch.Tensor, sigma: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """x0_hat = x - sigma v (sigma from the float32 grid)."""
    return x - sigma * v


def first_order_step(x0_hat: torch.Tensor, sample: torch.Tensor, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """DDIM with eta = 0 from sigma s to sigma t (float64 scalars): (1 - t) x0_hat + t eps_hat
    with eps_hat = (x - (1 - s) x0_hat) / s."""
    noise_hat = (sample - (1 - s) * x0_hat) / s
    return (1 - t) * x0_hat + torch.sqrt(t ** 2) * noise_hat


def second_order_step(m0: torch.Tensor, m1: torch.Tensor, sample: torch.Tensor, s1: torch.Tensor,
                      s0: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """DPM-Solver++ 2M from sigma s0 to t, m0 and m1 the data predictions at s0 and at the
    previous sigma s1 (float64 scalars)."""
    alpha_t, alpha_s0, alpha_s1 = 1 - t, 1 - s0, 1 - s1
    lambda_t = torch.log(alpha_t) - torch.log(t)
    lambda_s0 = torch.log(alpha_s0) - torch.log(s0)
    lambda_s1 = torch.log(alpha_s1) - torch.log(s1)  # -inf at sigma 1: the step is then first order
    h, h_0 = lambda_t - lambda_s0, lambda_s0 - lambda_s1
    r0 = h_0 / h
    d1 = (1.0 / r0) * (m0 - m1)
    return ((t / s0) * sample - (alpha_t * (torch.exp(-h) - 1.0)) * m0
            - 0.5 * (alpha_t * (torch.exp(-h) - 1.0)) * d1)


@torch.no_grad()
def dpm2_sample(transformer, noise: torch.Tensor, sigmas: torch.Tensor, cond: Conditioning,
                guidance_scale: float, dtype: torch.dtype, autocast, integer_timesteps: bool = False) -> torch.Tensor:
    """The final latent (float32) of DPM-Solver++ 2M from `noise` over `sigmas` (terminal 0 included)."""
    x = noise.float()
    sigmas = sigmas.to(x.device)
    sigmas64 = sigmas.to(torch.float64)
    n = len(sigmas) - 1
    previous = None  # the data prediction of the step before
    for i in range(n):
        v = guided_velocity(transformer, x, sigmas[i], cond, guidance_scale, dtype, autocast, integer_timesteps)
        x0_hat = data_prediction(x, sigmas[i], v)
        if i == 0 or i == n - 1:
            x = first_order_step(x0_hat, x, sigmas64[i], sigmas64[i + 1])
        else:
            x = second_order_step(x0_hat, previous, x, sigmas64[i - 1], sigmas64[i], sigmas64[i + 1])
        x = x.to(torch.float32)
        previous = x0_hat
    return x
