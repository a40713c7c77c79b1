"""Flow-GRPO's own functions, copied for the tests to run hpcnft's implementation against.

Sources, at the commits the tests were written against:
  * yifan123/flow_grpo (ac4c86e), MIT License, Copyright (c) 2025 Jie Liu:
      flow_grpo/diffusers_patch/sd3_sde_with_logprob.py  sde_step_with_logprob
      flow_grpo/diffusers_patch/sd3_pipeline_with_logprob.py  its denoising loop (step 7) as denoising_loop
      flow_grpo/stat_tracking.py                         PerPromptStatTracker.update (type 'grpo')
      scripts/train_sd3.py                               compute_log_prob, and the loss of the training
                                                         loop's body ("grpo logic", the KL term) as grpo_loss
  * NVlabs/DiffusionNFT, Apache License 2.0, Copyright NVIDIA Corporation:
      flow_grpo/diffusers_patch/solver.py                flow_grpo_step (its copy of the same SDE step)

Changes from the sources: the training loop's loss is wrapped in a function taking its inputs as
arguments; the pipeline's denoising loop takes the transformer, scheduler (timesteps set),
latents, embeddings and a generator as arguments, the generator drawing the transitions' noise
(the authors' draws come from the global RNG); compute_log_prob takes the scheduler and the
CFG/noise settings as arguments instead of the pipeline and the config; PerPromptStatTracker
keeps only what `update(type='grpo')` runs; `randn_tensor` is torch.randn; imports and logging
removed. The operations and their order are the authors'.

The MIT License's notice, which applies to the parts from yifan123/flow_grpo:

    Permission is hereby granted, free of charge, to any person obtaining a copy of this software
    and associated documentation files (the "Software"), to deal in the Software without
    restriction, including without limitation the rights to use, copy, modify, merge, publish,
    distribute, sublicense, and/or sell copies of the Software, and to permit persons to whom the
    Software is furnished to do so, subject to the following conditions: The above copyright
    notice and this permission notice shall be included in all copies or substantial portions of
    the Software. THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
    IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A
    PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE AUTHORS OR COPYRIGHT HOLDERS BE
    LIABLE FOR ANY CLAIM, DAMAGES OR OTHER LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR
    OTHERWISE, ARISING FROM, OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER
    DEALINGS IN THE SOFTWARE.

The parts from NVlabs/DiffusionNFT are used under the Apache License, Version 2.0
(http://www.apache.org/licenses/LICENSE-2.0), modified as said above.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch


# -- yifan123/flow_grpo: flow_grpo/diffusers_patch/sd3_sde_with_logprob.py --------------------------
def sde_step_with_logprob(
    self,
    model_output: torch.FloatTensor,
    timestep,
    sample: torch.FloatTensor,
    noise_level: float = 0.7,
    prev_sample: Optional[torch.FloatTensor] = None,
    generator: Optional[torch.Generator] = None,
):
    # bf16 can overflow here when compute prev_sample_mean, we must convert all variable to fp32
    model_output = model_output.float()
    sample = sample.float()
    if prev_sample is not None:
        prev_sample = prev_sample.float()

    step_index = [self.index_for_timestep(t) for t in timestep]
    prev_step_index = [step + 1 for step in step_index]
    sigma = self.sigmas[step_index].view(-1, 1, 1, 1)
    sigma_prev = self.sigmas[prev_step_index].view(-1, 1, 1, 1)
    sigma_max = self.sigmas[1].item()
    dt = sigma_prev - sigma

    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level

    # our sde
    prev_sample_mean = sample * (1 + std_dev_t ** 2 / (2 * sigma) * dt) + model_output * (
        1 + std_dev_t ** 2 * (1 - sigma) / (2 * sigma)) * dt

    if prev_sample is None:
        variance_noise = torch.randn(model_output.shape, generator=generator, dtype=model_output.dtype)
        prev_sample = prev_sample_mean + std_dev_t * torch.sqrt(-1 * dt) * variance_noise

    log_prob = (
        -((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
        - torch.log(std_dev_t * torch.sqrt(-1 * dt))
        - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
    )

    # mean along all but batch dimension
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))

    return prev_sample, log_prob, prev_sample_mean, std_dev_t


# -- yifan123/flow_grpo: flow_grpo/diffusers_patch/sd3_pipeline_with_logprob.py, "7. Denoising loop" -----
def denoising_loop(transformer, scheduler, latents, prompt_embeds, pooled_prompt_embeds, do_classifier_free_guidance,
                   guidance_scale, noise_level, generator):
    timesteps = scheduler.timesteps
    all_latents = [latents]
    all_log_probs = []
    for i, t in enumerate(timesteps):
        # expand the latents if we are doing classifier free guidance
        latent_model_input = torch.cat([latents] * 2) if do_classifier_free_guidance else latents
        # broadcast to batch dimension in a way that's compatible with ONNX/Core ML
        timestep = t.expand(latent_model_input.shape[0])
        noise_pred = transformer(
            hidden_states=latent_model_input,
            timestep=timestep,
            encoder_hidden_states=prompt_embeds,
            pooled_projections=pooled_prompt_embeds,
            return_dict=False,
        )[0]
        noise_pred = noise_pred.to(prompt_embeds.dtype)
        # perform guidance
        if do_classifier_free_guidance:
            noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
            noise_pred = noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)

        latents_dtype = latents.dtype

        latents, log_prob, prev_latents_mean, std_dev_t = sde_step_with_logprob(
            scheduler,
            noise_pred.float(),
            t.unsqueeze(0),
            latents.float(),
            noise_level=noise_level,
            generator=generator,
        )

        all_latents.append(latents)
        all_log_probs.append(log_prob)
        if latents.dtype != latents_dtype:
            latents = latents.to(latents_dtype)
    return latents, all_latents, all_log_probs


# -- NVlabs/DiffusionNFT: flow_grpo/diffusers_patch/solver.py ---------------------------------------
def flow_grpo_step(model_output, latents, eta, sigmas, index, prev_sample, generator=None):
    device = model_output.device
    sigma = sigmas[index].to(device)
    sigma_prev = sigmas[index + 1].to(device)
    sigma_max = sigmas[1].item()
    dt = sigma_prev - sigma  # neg dt

    pred_original_sample = latents - sigma * model_output

    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * eta

    prev_sample_mean = (
        latents * (1 + std_dev_t**2 / (2 * sigma) * dt)
        + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    )

    if prev_sample is None:
        variance_noise = torch.randn(model_output.shape, generator=generator, dtype=model_output.dtype)
        prev_sample = prev_sample_mean + std_dev_t * torch.sqrt(-1 * dt) * variance_noise

    log_prob = (
        -((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
        - torch.log(std_dev_t * torch.sqrt(-1 * dt))
        - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
    )

    # mean along all but batch dimension
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample, pred_original_sample, log_prob


# -- yifan123/flow_grpo: flow_grpo/stat_tracking.py -------------------------------------------------
class PerPromptStatTracker:
    def __init__(self, global_std=False):
        self.global_std = global_std
        self.stats = {}

    def update(self, prompts, rewards, type='grpo'):
        prompts = np.array(prompts)
        rewards = np.array(rewards, dtype=np.float64)
        unique = np.unique(prompts)
        advantages = np.empty_like(rewards) * 0.0
        for prompt in unique:
            prompt_rewards = rewards[prompts == prompt]
            if prompt not in self.stats:
                self.stats[prompt] = []
            self.stats[prompt].extend(prompt_rewards)
        for prompt in unique:
            self.stats[prompt] = np.stack(self.stats[prompt])
            prompt_rewards = rewards[prompts == prompt]  # Fix: Recalculate prompt_rewards for each prompt
            mean = np.mean(self.stats[prompt], axis=0, keepdims=True)
            if self.global_std:
                std = np.std(rewards, axis=0, keepdims=True) + 1e-4  # Use global std of all rewards
            else:
                std = np.std(self.stats[prompt], axis=0, keepdims=True) + 1e-4
            advantages[prompts == prompt] = (prompt_rewards - mean) / std
        return advantages


# -- yifan123/flow_grpo: scripts/train_sd3.py -------------------------------------------------------
def advantages_of(prompts, rewards, num_image_per_prompt: int, global_std: bool):
    """train_sd3.py's advantages: the per-prompt tracker, which it turns off with one image per
    prompt (`if config.sample.num_image_per_prompt == 1: config.per_prompt_stat_tracking = False`),
    then `(gathered_rewards['avg'] - gathered_rewards['avg'].mean()) / (gathered_rewards['avg'].std() + 1e-4)`."""
    if num_image_per_prompt != 1:
        return PerPromptStatTracker(global_std).update(prompts, rewards)
    rewards = np.asarray(rewards, dtype=np.float64)
    return (rewards - rewards.mean()) / (rewards.std() + 1e-4)


def compute_log_prob(transformer, scheduler, sample, j, embeds, pooled_embeds, cfg: bool, guidance_scale: float,
                     noise_level: float):
    if cfg:
        noise_pred = transformer(
            hidden_states=torch.cat([sample["latents"][:, j]] * 2),
            timestep=torch.cat([sample["timesteps"][:, j]] * 2),
            encoder_hidden_states=embeds,
            pooled_projections=pooled_embeds,
            return_dict=False,
        )[0]
        noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
        noise_pred_uncond = noise_pred_uncond.detach()
        noise_pred = (
            noise_pred_uncond
            + guidance_scale
            * (noise_pred_text - noise_pred_uncond)
        )
    else:
        noise_pred = transformer(
            hidden_states=sample["latents"][:, j],
            timestep=sample["timesteps"][:, j],
            encoder_hidden_states=embeds,
            pooled_projections=pooled_embeds,
            return_dict=False,
        )[0]

    # compute the log prob of next_latents given latents under the current model
    prev_sample, log_prob, prev_sample_mean, std_dev_t = sde_step_with_logprob(
        scheduler,
        noise_pred.float(),
        sample["timesteps"][:, j],
        sample["latents"][:, j].float(),
        prev_sample=sample["next_latents"][:, j].float(),
        noise_level=noise_level,
    )

    return prev_sample, log_prob, prev_sample_mean, std_dev_t


def grpo_loss(log_prob, old_log_probs_j, advantages_j, adv_clip_max, clip_range, beta,
              prev_sample_mean=None, prev_sample_mean_ref=None, std_dev_t=None):
    """The training loop's body from "# grpo logic" to the loss (and its logged clip fraction)."""
    # grpo logic
    advantages = torch.clamp(
        advantages_j,
        -adv_clip_max,
        adv_clip_max,
    )
    ratio = torch.exp(log_prob - old_log_probs_j)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(
        ratio,
        1.0 - clip_range,
        1.0 + clip_range,
    )
    policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
    if beta > 0:
        kl_loss = ((prev_sample_mean - prev_sample_mean_ref) ** 2).mean(
            dim=(1, 2, 3), keepdim=True) / (2 * std_dev_t ** 2)
        kl_loss = torch.mean(kl_loss)
        loss = policy_loss + beta * kl_loss
    else:
        kl_loss = None
        loss = policy_loss
    approx_kl = 0.5 * torch.mean((log_prob - old_log_probs_j) ** 2)
    clipfrac = torch.mean((torch.abs(ratio - 1.0) > clip_range).float())
    return loss, policy_loss, kl_loss, approx_kl, clipfrac
