"""The official DiffusionNFT recipe's options against transcriptions of the official code
(NVlabs/DiffusionNFT: flow_grpo/diffusers_patch/solver.py, pipeline_with_logprob.py,
flow_grpo/ema.py, flow_grpo/stat_tracking.py, scripts/train_nft_sd3.py), on the tiny models with
the same inputs: the dpm2 rollout's final latents, the integer DiT timesteps, the sigma draws, the
evaluation EMA of theta, grouping by prompt text and each adv_mode.

The transcriptions keep the official code's operations and their order; what only logs or draws
unused noise from the global RNG is left out (noted where it happens)."""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import List

import numpy as np
import pytest
import torch

from hpcnft.algo import shared_math
from hpcnft.algo.nft import formulas as nft
from hpcnft.algo.root_config import load_config
from hpcnft.algo.sampler import Conditioning, null_autocast, sigma_grid
from hpcnft.algo.solvers import sample
from hpcnft.models.families.sd3 import dit_timestep


# =============================================================================================
# Transcription: flow_grpo/diffusers_patch/solver.py (run_sampling with solver "dpm2" and
# "flow" deterministic) and pipeline_with_logprob.py's v_pred_fn for SD3 without CFG
# =============================================================================================
def official_v_pred_fn(transformer, prompt_embeds, pooled_prompt_embeds):
    def v_pred_fn(z, sigma):
        latent_model_input = z
        timesteps = torch.full([latent_model_input.shape[0]], sigma * 1000, device=z.device, dtype=torch.long)
        noise_pred = transformer(hidden_states=latent_model_input, timestep=timesteps,
                                 encoder_hidden_states=prompt_embeds, pooled_projections=pooled_prompt_embeds,
                                 return_dict=False)[0]
        noise_pred = noise_pred.to(prompt_embeds.dtype)
        return noise_pred
    return v_pred_fn


def official_run_sampling(v_pred_fn, z, sigma_schedule, solver="flow", determistic=False, eta=0.7):
    dtype = z.dtype
    if "dpm" in solver:
        order = int(solver[-1])
        dpm_state = DPMState(order=order)
    for i in range(len(sigma_schedule) - 1):
        sigma = sigma_schedule[i]
        pred = v_pred_fn(z.to(dtype), sigma)
        if solver == "flow":
            z, pred_original, log_prob = flow_grpo_step(model_output=pred.float(), latents=z.float(),
                                                        eta=eta if not determistic else 0, sigmas=sigma_schedule,
                                                        index=i, prev_sample=None)
        elif "dpm" in solver:
            assert determistic
            z, pred_original, log_prob = dpm_step(order, model_output=pred.float(), sample=z.float(), step_index=i,
                                                  timesteps=sigma_schedule[:-1], sigmas=sigma_schedule,
                                                  dpm_state=dpm_state)
        z = z.to(dtype)
    return z.to(dtype)


def flow_grpo_step(model_output, latents, eta, sigmas, index, prev_sample, generator=None):
    device = model_output.device
    sigma = sigmas[index].to(device)
    sigma_prev = sigmas[index + 1].to(device)
    sigma_max = sigmas[1].item()
    dt = sigma_prev - sigma
    pred_original_sample = latents - sigma * model_output
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * eta
    prev_sample_mean = (latents * (1 + std_dev_t**2 / (2 * sigma) * dt)
                        + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt)
    if prev_sample is None:
        variance_noise = torch.randn(model_output.shape, generator=generator, device=device, dtype=model_output.dtype)
        prev_sample = prev_sample_mean + std_dev_t * torch.sqrt(-1 * dt) * variance_noise
    return prev_sample, pred_original_sample, None  # (the log-prob is not used by NFT)


@dataclass
class DPMState:
    order: int
    model_outputs: List[torch.Tensor] = None
    lower_order_nums = 0

    def __post_init__(self):
        self.model_outputs = [None] * self.order

    def update(self, model_output):
        for i in range(self.order - 1):
            self.model_outputs[i] = self.model_outputs[i + 1]
        self.model_outputs[-1] = model_output

    def update_lower_order(self):
        if self.lower_order_nums < self.order:
            self.lower_order_nums += 1


def dpm_step(order, model_output, sample, step_index, timesteps, sigmas, dpm_state=None):
    lower_order_final = step_index == len(timesteps) - 1
    lower_order_second = (step_index == len(timesteps) - 2) and len(timesteps) < 15
    model_output = convert_model_output(model_output, sample, sigmas, step_index=step_index)
    dpm_state.update(model_output)
    sample = sample.to(torch.float32)
    if order == 1 or dpm_state.lower_order_nums < 1 or lower_order_final:
        if step_index == 0 or lower_order_final:
            prev_sample, _, _, _ = ddim_update(model_output, sigmas.to(torch.float64), step_index, sample, eta=0.0)
        else:
            prev_sample = dpm_solver_first_order_update(model_output, sigmas.to(torch.float64), step_index, sample)
    elif order == 2 or dpm_state.lower_order_nums < 2 or lower_order_second:
        prev_sample = multistep_dpm_solver_second_order_update(dpm_state.model_outputs, sigmas.to(torch.float64),
                                                               step_index, sample)
    else:
        assert False
    dpm_state.update_lower_order()
    prev_sample = prev_sample.to(model_output.dtype)
    return prev_sample, model_output, None


def convert_model_output(model_output, sample, sigmas, step_index):
    sigma_t = sigmas[step_index]
    x0_pred = sample - sigma_t * model_output
    return x0_pred


def ddim_update(model_output, sigmas, step_index, sample=None, noise=None, eta=1.0):
    t, s = sigmas[step_index + 1], sigmas[step_index]
    std_dev_t = eta * t
    dt_sqrt = torch.sqrt(1.0 - t**2 * (1 - s) ** 2 / (s**2 * (1 - t) ** 2))
    rho_t = std_dev_t * dt_sqrt
    noise_pred = (sample - (1 - s) * model_output) / s
    if noise is None:
        noise = torch.randn_like(model_output)
    prev_mean = (1 - t) * model_output + torch.sqrt(t**2 - rho_t**2) * noise_pred
    x_t = prev_mean + rho_t * noise
    return x_t, prev_mean, std_dev_t, dt_sqrt


def dpm_solver_first_order_update(model_output, sigmas, step_index, sample=None):
    sigma_t, sigma_s = sigmas[step_index + 1], sigmas[step_index]
    alpha_t, sigma_t = _sigma_to_alpha_sigma_t(sigma_t)
    alpha_s, sigma_s = _sigma_to_alpha_sigma_t(sigma_s)
    lambda_t = torch.log(alpha_t) - torch.log(sigma_t)
    lambda_s = torch.log(alpha_s) - torch.log(sigma_s)
    h = lambda_t - lambda_s
    return (sigma_t / sigma_s) * sample - (alpha_t * (torch.exp(-h) - 1.0)) * model_output


def multistep_dpm_solver_second_order_update(model_output_list, sigmas, step_index, sample=None):
    sigma_t, sigma_s0, sigma_s1 = sigmas[step_index + 1], sigmas[step_index], sigmas[step_index - 1]
    alpha_t, sigma_t = _sigma_to_alpha_sigma_t(sigma_t)
    alpha_s0, sigma_s0 = _sigma_to_alpha_sigma_t(sigma_s0)
    alpha_s1, sigma_s1 = _sigma_to_alpha_sigma_t(sigma_s1)
    lambda_t = torch.log(alpha_t) - torch.log(sigma_t)
    lambda_s0 = torch.log(alpha_s0) - torch.log(sigma_s0)
    lambda_s1 = torch.log(alpha_s1) - torch.log(sigma_s1)
    m0, m1 = model_output_list[-1], model_output_list[-2]
    h, h_0 = lambda_t - lambda_s0, lambda_s0 - lambda_s1
    r0 = h_0 / h
    D0, D1 = m0, (1.0 / r0) * (m0 - m1)
    return ((sigma_t / sigma_s0) * sample - (alpha_t * (torch.exp(-h) - 1.0)) * D0
            - 0.5 * (alpha_t * (torch.exp(-h) - 1.0)) * D1)


def _sigma_to_alpha_sigma_t(sigma):
    return 1 - sigma, sigma


# =============================================================================================
# Transcription: flow_grpo/ema.py (EMAModuleWrapper, what train_nft_sd3.py uses) and
# flow_grpo/stat_tracking.py (PerPromptStatTracker.update)
# =============================================================================================
class EMAModuleWrapper:
    def __init__(self, parameters, decay=0.9999, update_step_interval=1, device=None):
        self.ema_parameters = [p.clone().detach().to(device) for p in parameters]
        self.decay, self.update_step_interval = decay, update_step_interval

    def get_current_decay(self, optimization_step) -> float:
        return min((1 + optimization_step) / (10 + optimization_step), self.decay)

    @torch.no_grad()
    def step(self, parameters, optimization_step):
        one_minus_decay = 1 - self.get_current_decay(optimization_step)
        if (optimization_step + 1) % self.update_step_interval == 0:
            for ema_parameter, parameter in zip(self.ema_parameters, parameters, strict=True):
                if parameter.requires_grad:
                    ema_parameter.add_(one_minus_decay * (parameter - ema_parameter))


def per_prompt_stat_tracker_update(prompts, rewards, global_std=True):
    prompts = np.array(prompts)
    rewards = np.array(rewards, dtype=np.float64)
    unique = np.unique(prompts)
    advantages = np.empty_like(rewards) * 0.0
    stats = {}
    for prompt in unique:
        stats.setdefault(prompt, []).extend(rewards[prompts == prompt])
    for prompt in unique:
        stats[prompt] = np.stack(stats[prompt])
        prompt_rewards = rewards[prompts == prompt]
        mean = np.mean(stats[prompt], axis=0, keepdims=True)
        if global_std:
            std = np.std(rewards, axis=0, keepdims=True) + 1e-4
        else:
            std = np.std(stats[prompt], axis=0, keepdims=True) + 1e-4
        advantages[prompts == prompt] = (prompt_rewards - mean) / std
    return advantages


def official_r(advantages, adv_clip_max, adv_mode):
    """scripts/train_nft_sd3.py: the clipped advantage, the adv_mode variants, r."""
    advantages_clip = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    if adv_mode == "positive_only":
        advantages_clip = torch.clamp(advantages_clip, 0, adv_clip_max)
    elif adv_mode == "negative_only":
        advantages_clip = torch.clamp(advantages_clip, -adv_clip_max, 0)
    elif adv_mode == "one_only":
        advantages_clip = torch.where(advantages_clip > 0, torch.ones_like(advantages_clip),
                                      torch.zeros_like(advantages_clip))
    elif adv_mode == "binary":
        advantages_clip = torch.sign(advantages_clip)
    normalized_advantages_clip = (advantages_clip / adv_clip_max) / 2.0 + 0.5
    return torch.clamp(normalized_advantages_clip, 0, 1)


# =============================================================================================
# The tiny models and inputs shared by the sampler cases
# =============================================================================================
@pytest.fixture(scope="module")
def tiny_dit(tiny_models):
    import os

    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    sd3 = tiny_models[0]
    transformer = SD3Transformer2DModel.from_pretrained(os.path.join(sd3, "transformer")).eval()
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(os.path.join(sd3, "scheduler"))
    return transformer, scheduler


def _inputs(transformer, n=3, size=8, tokens=6, seed=5):
    c = transformer.config
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(n, c.in_channels, size, size, generator=g)
    pe = torch.randn(n, tokens, c.joint_attention_dim, generator=g)
    pooled = torch.randn(n, c.pooled_projection_dim, generator=g)
    return noise, pe, pooled


def _official_sigmas(scheduler, num_steps):
    """pipeline_with_logprob: retrieve_timesteps on the pipeline's scheduler, then sigmas.float()."""
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import retrieve_timesteps

    sched = type(scheduler).from_config(scheduler.config)
    retrieve_timesteps(sched, num_steps, "cpu", sigmas=None)
    return sched.sigmas.float()


@pytest.mark.parametrize("num_steps", [10, 4, 1])
def test_dpm2_final_latents_equal_the_official_solver(tiny_dit, num_steps):
    transformer, scheduler = tiny_dit
    noise, pe, pooled = _inputs(transformer)
    official_sigmas = _official_sigmas(scheduler, num_steps)
    assert torch.equal(sigma_grid(scheduler, num_steps), official_sigmas)
    with torch.no_grad():
        want = official_run_sampling(official_v_pred_fn(transformer, pe, pooled), noise.clone(), official_sigmas,
                                     solver="dpm2", determistic=True)
    got = sample("dpm2", transformer, noise.clone(), sigma_grid(scheduler, num_steps), Conditioning(pe, pooled),
                 1.0, torch.float32, null_autocast, integer_timesteps=True)
    assert got.dtype == torch.float32
    assert torch.equal(got, want)
    euler = sample("euler", transformer, noise.clone(), sigma_grid(scheduler, num_steps), Conditioning(pe, pooled),
                   1.0, torch.float32, null_autocast, integer_timesteps=True)
    if num_steps > 2:  # one or two steps are first order only: then both solvers agree
        assert not torch.allclose(got, euler, rtol=0, atol=1e-4)


def test_dpm2_second_order_steps_use_the_previous_data_prediction(tiny_dit):
    """A solver that dropped the multistep term (first order at every step) would not match:
    the official second-order update is what the 10-step rollout takes."""
    from hpcnft.algo import dpm_solver

    transformer, scheduler = tiny_dit
    noise, pe, pooled = _inputs(transformer, seed=9)
    sigmas = sigma_grid(scheduler, 10)
    got = dpm_solver.dpm2_sample(transformer, noise, sigmas, Conditioning(pe, pooled), 1.0, torch.float32,
                                 null_autocast, True)
    x, s64 = noise.clone(), sigmas.to(torch.float64)
    with torch.no_grad():
        for i in range(10):
            t = torch.trunc(sigmas[i] * 1000).expand(len(x))
            v = transformer(hidden_states=x, timestep=t, encoder_hidden_states=pe, pooled_projections=pooled,
                            return_dict=False)[0]
            x = dpm_solver.first_order_step(x - sigmas[i] * v, x, s64[i], s64[i + 1]).float()
    assert not torch.allclose(got, x, rtol=0, atol=1e-5)


def test_euler_with_integer_timesteps_equals_the_official_deterministic_flow_sampler(tiny_dit):
    """The official evaluation (and its rollout with solver "flow"): flow_grpo_step with eta 0
    and long(1000 sigma) timesteps."""
    transformer, scheduler = tiny_dit
    noise, pe, pooled = _inputs(transformer, seed=7)
    with torch.no_grad():
        want = official_run_sampling(official_v_pred_fn(transformer, pe, pooled), noise.clone(),
                                     _official_sigmas(scheduler, 10), solver="flow", determistic=True)
    got = sample("euler", transformer, noise.clone(), sigma_grid(scheduler, 10), Conditioning(pe, pooled), 1.0,
                 torch.float32, null_autocast, integer_timesteps=True)
    assert torch.equal(got, want)
    float_t = sample("euler", transformer, noise.clone(), sigma_grid(scheduler, 10), Conditioning(pe, pooled), 1.0,
                     torch.float32, null_autocast)
    assert not torch.equal(float_t, want)  # the float 1000 sigma is another input to the DiT


def test_integer_timesteps_are_the_official_long_of_1000_sigma(tiny_dit):
    _, scheduler = tiny_dit
    sigmas = sigma_grid(scheduler, 10)[:-1]
    official = [torch.full([1], s * 1000, dtype=torch.long).item() for s in _official_sigmas(scheduler, 10)[:-1]]
    assert official == [1000, 960, 913, 857, 790, 707, 602, 464, 278, 8]
    tau = dit_timestep(sigmas, integer=True)
    assert tau.dtype == torch.float32 and tau.tolist() == [float(t) for t in official]
    assert dit_timestep(sigmas).tolist() != tau.tolist()  # the default keeps the float


def test_the_dit_sees_the_same_values_as_with_the_official_long_timestep(tiny_dit):
    transformer, _ = tiny_dit
    noise, pe, pooled = _inputs(transformer, seed=3)
    sigma = torch.tensor([0.96012926, 0.27804878, 0.00892857])
    from hpcnft.algo.sampler import velocity

    with torch.no_grad():
        ours = velocity(transformer, noise, sigma, pe, pooled, torch.float32, integer_timesteps=True)
        theirs = transformer(hidden_states=noise, timestep=(sigma * 1000).long(), encoder_hidden_states=pe,
                             pooled_projections=pooled, return_dict=False)[0]
    assert torch.equal(ours, theirs)


# =============================================================================================
# sigma draws: official perms_time = randperm(T) per sample, the first K trained
# =============================================================================================
def test_random_per_sample_is_the_official_draw_with_the_same_generator():
    from hpcnft.common.determinism import stable_hash

    T, K = 10, 9
    for i in range(50):
        g = torch.Generator().manual_seed(stable_hash("nft_sigma_shuffle", 1234, i))
        official = torch.stack([torch.randperm(T, generator=g)])[0, :K].tolist()  # perms_time[:, :K]
        assert nft.trained_sigma_indices(T, K, "random_per_sample", True, 1234, i) == official
        # the older name draws the same
        assert nft.trained_sigma_indices(T, K, "drop_random", True, 1234, i) == official


def test_random_per_sample_law_is_k_of_t_uniform_in_random_order():
    """The official law: each sample's K sigmas a uniformly random K-subset of the T, in uniformly
    random order. 4,000 draws: every subset (10 of them for K=9) and every first index near 1/10."""
    n, T = 4000, 10
    draws = [nft.trained_sigma_indices(T, 9, "random_per_sample", True, 99, i) for i in range(n)]
    assert all(len(d) == 9 and len(set(d)) == 9 for d in draws)
    dropped = Counter((set(range(T)) - set(d)).pop() for d in draws)
    first = Counter(d[0] for d in draws)
    for counts in (dropped, first):
        assert set(counts) == set(range(T))
        chi2 = sum((c - n / T) ** 2 / (n / T) for c in counts.values())
        assert chi2 < 27.9, counts  # the 99.9 % point of chi-square with 9 degrees of freedom
    # K = 5 of 10: all 252 subsets occur
    subsets = Counter(frozenset(nft.trained_sigma_indices(T, 5, "random_per_sample", True, 7, i))
                      for i in range(n))
    assert len(subsets) == math.comb(T, 5)


def test_random_per_sample_reaches_the_pairs():
    from hpcnft.algo.nft.pairs import train_sigma_pairs

    cfg = load_config("tiny", ["nft.timestep_strategy=random_per_sample"])
    pairs = train_sigma_pairs(cfg, list(range(40)), step=1)
    assert len(pairs) == 9 * 40
    assert {j for _, j in pairs} == set(range(10))  # sigma_9 is trained too, unlike "first"


# =============================================================================================
# the evaluation EMA of theta
# =============================================================================================
def test_eval_ema_decay_is_the_official_warm_up():
    assert shared_math.eval_ema_decay(1, 0.9) == 2 / 11
    assert shared_math.eval_ema_decay(10, 0.9) == 11 / 20
    assert shared_math.eval_ema_decay(80, 0.9) == 0.9 and shared_math.eval_ema_decay(81, 0.9) == 0.9
    assert shared_math.eval_ema_decay(1000, 0.99) == 0.99


@pytest.fixture
def world_one(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("every", [1, 8])
def test_eval_ema_weights_equal_the_official_ema(tiny_dit, world_one, every):
    """A real Policy (FSDP2 over one rank) under the trainer's optimizer step against
    EMAModuleWrapper(decay 0.9, update_step_interval) stepped with the same parameters after each
    of 20 'optimizer steps' (seeded moves of theta; no gradients, so AdamW leaves them): every
    step (DiffusionNFT's official recipe), or after every 8th (Flow-GRPO's, eval.ema_update_every)."""
    from diffusers import SD3Transformer2DModel
    from torch.distributed.device_mesh import init_device_mesh

    from hpcnft.algo.policy import Policy
    from hpcnft.common.tensors import local_shard

    transformer, _ = tiny_dit
    from hpcnft.algo.nft.trainer import Trainer

    cfg = load_config("tiny_official", [f"eval.ema_update_every={every}"])
    policy = Policy(cfg, SD3Transformer2DModel.from_config(transformer.config), torch.device("cpu"),
                    init_device_mesh("cpu", (1,)))
    trainer = Trainer(cfg, policy, None, 1)
    params = [local_shard(p) for p in policy.trainable]  # requires_grad: the official step checks it
    official = EMAModuleWrapper(params, decay=0.9, update_step_interval=every)
    params = [p.detach() for p in params]  # the same storage
    start = [e.clone() for e in policy.eval_shadow]
    g = torch.Generator().manual_seed(11)
    for k in range(1, 21):
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn(p.shape, generator=g) * 0.01)
        trainer._optimizer_step(k)
        official.step([local_shard(p) for p in policy.trainable], k)
        moved = not all(torch.equal(a, b) for a, b in zip(policy.eval_shadow, start))
        assert moved == (k + 1 >= every)  # the first move after step every - 1
    assert all(torch.equal(a, b) for a, b in zip(policy.eval_shadow, official.ema_parameters))
    assert not all(torch.equal(a, b) for a, b in zip(policy.eval_shadow, policy.shadow))  # not pi_old
    live = [p.clone() for p in params]
    with policy.eval_weights():
        assert all(torch.equal(p, e) for p, e in zip(params, policy.eval_shadow))
    assert all(torch.equal(p, x) for p, x in zip(params, live))  # theta back after the evaluation


def test_eval_policy_old_keeps_no_second_shadow(tiny_dit, world_one):
    from diffusers import SD3Transformer2DModel
    from torch.distributed.device_mesh import init_device_mesh

    from hpcnft.algo.policy import Policy

    transformer, _ = tiny_dit
    policy = Policy(load_config("tiny"), SD3Transformer2DModel.from_config(transformer.config),
                    torch.device("cpu"), init_device_mesh("cpu", (1,)))
    assert policy.eval_shadow is None


# =============================================================================================
# advantages grouped by prompt text, adv_mode
# =============================================================================================
PROMPTS = ["a cat", "a dog", "a cat", "a fox", "a dog", "a cat", "a fox", "a fox"]  # a step holding "a cat" thrice
REWARDS = [0.31, 0.12, 0.47, 0.05, 0.26, 0.18, 0.44, 0.09]


def test_grouping_by_prompt_equals_the_official_stat_tracker():
    want = per_prompt_stat_tracker_update(PROMPTS, REWARDS, global_std=True)
    got = nft.advantages(torch.tensor(REWARDS, dtype=torch.float64), group_size=2, std_estimator="population",
                         prompts=PROMPTS)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-15)
    by_position = nft.advantages(torch.tensor(REWARDS, dtype=torch.float64), 2, "population")
    assert not np.allclose(by_position.numpy(), want)  # consecutive pairs are other groups


def test_grouping_by_prompt_equals_grouping_by_position_when_prompts_are_distinct():
    prompts = [p for p in ("x", "y", "z", "w") for _ in range(2)]
    r = torch.tensor(REWARDS, dtype=torch.float64)
    for estimator in ("unbiased", "population"):
        np.testing.assert_allclose(nft.advantages(r, 2, estimator, prompts).numpy(),
                                   nft.advantages(r, 2, estimator).numpy(), rtol=1e-12, atol=1e-15)


def test_grouping_by_prompt_refuses_a_prompt_list_of_another_length():
    with pytest.raises(ValueError, match="7 prompts for 8 rewards"):
        nft.advantages(torch.tensor(REWARDS), 2, "population", PROMPTS[:7])


@pytest.mark.parametrize("mode", ["all", "positive_only", "negative_only", "one_only", "binary"])
def test_each_adv_mode_equals_the_official_r(mode):
    adv = torch.tensor([-7.0, -5.0, -2.5, -1e-3, 0.0, 1e-3, 0.7, 2.5, 5.0, 9.0], dtype=torch.float64)
    want = official_r(adv, 5, mode)
    got = nft.optimality_r(adv, 5.0, mode)
    assert torch.equal(got, want), (mode, got, want)


def test_adv_modes_differ_from_each_other():
    adv = torch.tensor([-2.5, 0.0, 2.5], dtype=torch.float64)
    rs = {m: tuple(nft.optimality_r(adv, 5.0, m).tolist()) for m in nft.ADV_MODES}
    assert rs["all"] == (0.25, 0.5, 0.75)
    assert rs["positive_only"] == (0.5, 0.5, 0.75)
    assert rs["negative_only"] == (0.25, 0.5, 0.5)
    assert rs["one_only"] == (0.5, 0.5, 0.6)
    assert rs["binary"] == (0.4, 0.5, 0.6)


# =============================================================================================
# config
# =============================================================================================
@pytest.mark.parametrize("key, value", [("rollout.solver", "heun"), ("nft.group_by", "text"),
                                        ("nft.adv_mode", "negative"), ("eval.policy", "theta"),
                                        ("nft.timestep_strategy", "random")])
def test_unknown_choices_are_refused_naming_the_key(key, value):
    from hpcnft.common.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: '{value}' is not one of"):
        load_config("tiny", [f"{key}={value}"])


def test_eval_ema_decay_must_lie_in_the_unit_interval():
    from hpcnft.common.errors import ConfigError

    with pytest.raises(ConfigError, match=r"eval.ema_decay: must be within \[0, 1\]"):
        load_config("tiny", ["eval.ema_decay=1.5"])


def test_defaults_keep_the_reference_recipe():
    cfg = load_config("sd35m_pickscore")
    assert (cfg.rollout.solver, cfg.rollout.integer_timesteps, cfg.nft.group_by, cfg.nft.adv_mode,
            cfg.eval.policy) == ("euler", False, "position", "all", "old")


def test_the_official_recipe_holds_the_official_values():
    cfg = load_config("sd35m_pickscore_official")
    assert (cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt, cfg.samples_per_step) == (48, 24, 1152)
    assert (cfg.rollout.num_steps, cfg.rollout.solver, cfg.rollout.integer_timesteps) == (10, "dpm2", True)
    assert (cfg.rollout.max_sequence_length, cfg.rollout.guidance_scale, cfg.rollout.height) == (128, 1.0, 512)
    assert cfg.trained_steps == 9
    assert (cfg.nft.timestep_strategy, cfg.nft.std_estimator, cfg.nft.kl_beta) == ("random_per_sample", "population",
                                                                                   1e-4)
    assert (cfg.nft.group_by, cfg.nft.adv_mode, cfg.nft.beta, cfg.nft.adv_clip_max) == ("prompt", "all", 1.0, 5.0)
    assert (cfg.eval.policy, cfg.eval.ema_decay, cfg.eval.num_steps, cfg.eval.every, cfg.eval.at_start) == \
        ("ema", 0.9, 40, 10, True)
    assert (cfg.ema.ramp, cfg.ema.max, cfg.ema.flat_steps) == (0.001, 0.5, 0)  # official decay_type 1
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.grad_clip, cfg.train.precision) == \
        (3e-4, 1e-4, 1.0, "fp16")
    assert (cfg.train.lora_rank, cfg.train.lora_alpha) == (32, 64)
    tiny = load_config("tiny_official")
    for key in ("rollout.solver", "rollout.integer_timesteps", "nft.timestep_strategy", "nft.std_estimator",
                "nft.kl_beta", "nft.group_by", "eval.policy", "eval.ema_decay", "data.shuffle"):
        section, name = key.split(".")
        assert getattr(getattr(tiny, section), name) == getattr(getattr(cfg, section), name), key

