"""MixGRPO's math, sampler and update against hand computations, and (where HPCNFT_MIXGRPO_REPO
names a checkout of Tencent-Hunyuan/MixGRPO) against the authors' own functions run from their
repository: GRPOTrainingStates' window schedule, flow_grpo_step (deterministic outside the window,
stochastic in it) and the loss of train_grpo_flux.py's training loop assembled from them."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from hpcnft.algo.mixgrpo import formulas as mix
from hpcnft.algo.mixgrpo.sampler import mixed_sample
from hpcnft.algo.root_config import load_config
from hpcnft.algo.sampler import Conditioning, guided_velocity, null_autocast, sigma_grid
from hpcnft.algo.sde_policy import sde_step

REPO = os.environ.get("HPCNFT_MIXGRPO_REPO", "")
NOISE_LEVEL = 0.7


@pytest.fixture(scope="module")
def authors():
    """The authors' modules, imported from their checkout (HPCNFT_MIXGRPO_REPO)."""
    if not os.path.isfile(os.path.join(REPO, "fastvideo", "utils", "grpo_states.py")):
        pytest.skip("HPCNFT_MIXGRPO_REPO does not name a checkout of Tencent-Hunyuan/MixGRPO")
    sys.path.insert(0, REPO)
    try:
        from fastvideo.utils import grpo_states, sampling_utils
    finally:
        sys.path.remove(REPO)
    return grpo_states, sampling_utils


@pytest.fixture(scope="module")
def tiny_dit(tiny_models):
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    transformer = SD3Transformer2DModel.from_pretrained(os.path.join(tiny_models[0], "transformer")).eval()
    return transformer, FlowMatchEulerDiscreteScheduler.from_pretrained(os.path.join(tiny_models[0], "scheduler"))


def randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# -- the window --------------------------------------------------------------------------------
def test_the_window_slides_by_its_stride_every_so_many_steps_and_rolls_back():
    at = lambda step, **kw: mix.window(step, 10, 4, 3, 1, True, **kw)  # noqa: E731 - T = 10: indices up to 7
    assert [at(s) for s in (1, 3, 4, 6, 7)] == [[0, 1, 2, 3]] * 2 + [[1, 2, 3, 4]] * 2 + [[2, 3, 4, 5]]
    assert [at(s) for s in (19, 22, 25, 27, 28)] == [[6, 7], [7], [], [], [0, 1, 2, 3]]  # T - 2 = 8 is the end
    assert mix.window(40, 10, 4, 3, 1, False) == [] and mix.window(40, 10, 4, 3, 2, True) == [6, 7]
    assert mix.window_start(28, 10, 3, 1, True) == 0 and mix.window_start(28, 10, 3, 1, False) == 8


def test_the_window_is_the_authors_training_states(authors):
    grpo_states, _ = authors
    for steps, size, every, stride, roll_back in ((25, 4, 25, 1, True), (10, 4, 3, 1, True), (10, 3, 2, 2, False),
                                                  (12, 5, 1, 3, True)):
        theirs = grpo_states.GRPOTrainingStates(iters_per_group=every, group_size=size, max_timesteps=steps - 2,
                                                sample_strategy="progressive", prog_overlap=True,
                                                prog_overlap_step=stride, roll_back=roll_back)
        for step in range(1, 400):
            assert mix.window(step, steps, size, every, stride, roll_back) == theirs.get_current_timesteps(), step
            theirs.update_iteration()


# -- advantages ----------------------------------------------------------------------------------
def test_group_advantages_are_each_prompt_s_standardised_rewards():
    r = torch.tensor([0.3, 0.1, 0.5, 0.2, 0.2, 0.9], dtype=torch.float32)
    got = mix.group_advantages(r, 3)
    for g in range(2):
        group = r[3 * g:3 * g + 3].double()
        want = (group - group.mean()) / (group.std() + 1e-8)  # N - 1, as torch's default
        assert torch.equal(got[3 * g:3 * g + 3], want)
    assert got.dtype == torch.float64 and abs(float(got[:3].sum())) < 1e-12


# -- the mixed rollout -------------------------------------------------------------------------------
def test_the_rollout_follows_the_ode_outside_the_window_and_the_sde_in_it(tiny_dit):
    transformer, scheduler = tiny_dit
    sigmas, window = sigma_grid(scheduler, 10), [3, 4, 5]
    noise, sde_noise = randn(2, 16, 8, 8, seed=1), randn(2, 3, 16, 8, 8, seed=2)
    cond = Conditioning(randn(2, 6, transformer.config.joint_attention_dim, seed=3), randn(2, 64, seed=4))
    x0, states, log_probs = mixed_sample(transformer, noise, sde_noise, sigmas, cond, 1.0, torch.float32,
                                         null_autocast, NOISE_LEVEL, window)
    assert states.shape == (2, 4, 16, 8, 8) and log_probs.shape == (2, 3)
    x = noise.float()  # step by step: Euler, then sde_step with the window's noise, then Euler
    for k in range(10):
        v = guided_velocity(transformer, x, sigmas[k], cond, 1.0, torch.float32, null_autocast)
        if k in window:
            if k == window[0]:
                assert torch.equal(states[:, 0], x)
            x, lp, _, _ = sde_step(x, v, sigmas[k], sigmas[k + 1], sigmas[1].item(), NOISE_LEVEL,
                                   noise=sde_noise[:, window.index(k)])
            assert torch.equal(states[:, window.index(k) + 1], x) and torch.equal(log_probs[:, window.index(k)], lp)
        else:
            x = x + (sigmas[k + 1] - sigmas[k]) * v
    assert torch.equal(x0, x)
    empty = mixed_sample(transformer, noise, sde_noise[:, :0], sigmas, cond, 1.0, torch.float32, null_autocast,
                         NOISE_LEVEL, [])
    assert empty[1].shape == (2, 1, 16, 8, 8) and empty[2].shape == (2, 0) and torch.equal(empty[1][:, 0], empty[0])


def test_each_rollout_step_is_the_authors_flow_grpo_step(authors, tiny_dit):
    """Outside the window their deterministic step, inside it their stochastic one with the
    same noise (drawn from one generator for both): the same bits, and the same log-probability
    of a given next state."""
    _, sampling_utils = authors
    sigmas = sigma_grid(tiny_dit[1], 10)
    for k in range(10):
        x, v = randn(3, 16, 8, 8, seed=k), randn(3, 16, 8, 8, seed=50 + k)
        ode = sampling_utils.flow_grpo_step(v, x, NOISE_LEVEL, sigmas, k, None, determistic=True)[0]
        assert torch.equal(ode, x + (sigmas[k + 1] - sigmas[k]) * v)
        if k == 9:
            continue  # the last step (sigma_next = 0) is never in a window: T - 2 ends it
        g = torch.Generator().manual_seed(k)
        theirs = sampling_utils.flow_grpo_step(v, x, NOISE_LEVEL, sigmas, k, None, generator=g)
        noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(k))
        ours = sde_step(x, v, sigmas[k], sigmas[k + 1], sigmas[1].item(), NOISE_LEVEL, noise=noise)
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[2]) and torch.equal(ours[2], theirs[3])
        again = sampling_utils.flow_grpo_step(v, x, NOISE_LEVEL, sigmas, k, theirs[0])
        assert torch.equal(sde_step(x, v, sigmas[k], sigmas[k + 1], sigmas[1].item(), NOISE_LEVEL,
                                    prev_sample=theirs[0])[1], again[2])


# -- one update ----------------------------------------------------------------------------------------
@pytest.fixture
def world_one(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("with_authors", [False, True], ids=["formula", "authors-step"])
def test_one_update_s_gradient_is_the_authors_loss(tiny_dit, world_one, request, with_authors):
    """MixGRPOTrainer.step (one update of 4 samples over the window [3, 6) of a 10-step grid, LoRA
    under FSDP2, micro-batches of 4 pairs) against train_grpo_flux.py's loss on the same weights:
    per sample and window step, mean(max(-A ratio, -A clamp(ratio, 1 +- eps))) / (accumulation x
    window), A clipped at 5, ratio from the step's log-probability ("authors-step": their
    flow_grpo_step's), summed over the update: loss and gradient equal to rounding."""
    from diffusers import SD3Transformer2DModel
    from torch.distributed.device_mesh import init_device_mesh

    from hpcnft.algo.mixgrpo.trainer import MixGRPOTrainer
    from hpcnft.algo.policy import Policy
    from hpcnft.algo.transition_trainer import SDEBatch
    from hpcnft.common.tensors import local_shard

    step_fn = None
    if with_authors:
        step_fn = request.getfixturevalue("authors")[1].flow_grpo_step
    transformer, scheduler = tiny_dit
    cfg = load_config("tiny_learns_mixgrpo", ["mixgrpo.updates_per_step=1", "mixgrpo.clip_range=2e-4",
                                               "train.micro_batch=4"])
    policy = Policy(cfg, SD3Transformer2DModel.from_config(transformer.config), torch.device("cpu"),
                    init_device_mesh("cpu", (1,)))
    with torch.no_grad():
        for p in policy.trainable:
            local_shard(p).add_(randn(*local_shard(p).shape, seed=p.numel()) * 0.02)
    trainer = MixGRPOTrainer(cfg, policy, None, 1)
    n, window = 4, [3, 4, 5]
    sigmas = sigma_grid(scheduler, 10)
    cond = Conditioning(randn(n, 6, transformer.config.joint_attention_dim, seed=31), randn(n, 64, seed=32))
    _, states, log_probs = mixed_sample(policy.transformer, randn(n, 16, 8, 8, seed=35), randn(n, 3, 16, 8, 8, seed=36),
                                        sigmas, cond, 1.0, torch.float32, policy.autocast, NOISE_LEVEL, window)
    old = log_probs + (torch.rand(n, 3, generator=torch.Generator().manual_seed(37)) - 0.5) * 8e-4
    adv = torch.tensor([1.3, -0.4, 6.0, -2.2], dtype=torch.float64)
    batch = SDEBatch(states, old, cond.prompt_embeds, cond.pooled, None, None, adv, list(range(n)), n, first=3)
    grads = []

    def keep_grads(update):
        grads.append([local_shard(p.grad).clone() for p in policy.trainable])
        return 0.0, False
    trainer._optimizer_step = keep_grads
    metrics = trainer.step(batch, sigmas, step=1)

    for p in policy.trainable:
        p.grad = None
    total = 0.0
    for i in range(n):  # train_one_step: one sample a batch, every window step, gradients accumulated
        for j, t in enumerate(window):
            v = guided_velocity(policy.transformer, states[i:i + 1, j], sigmas[t], Conditioning(
                cond.prompt_embeds[i:i + 1], cond.pooled[i:i + 1]), 1.0, torch.float32, policy.autocast)
            if step_fn is not None:
                new_log_prob = step_fn(v, states[i:i + 1, j], NOISE_LEVEL, sigmas, t, states[i:i + 1, j + 1])[2]
            else:
                new_log_prob = sde_step(states[i:i + 1, j], v, sigmas[t], sigmas[t + 1], sigmas[1].item(), NOISE_LEVEL,
                                        prev_sample=states[i:i + 1, j + 1])[1]
            a = torch.clamp(adv[i:i + 1], -5.0, 5.0)
            ratio = torch.exp(new_log_prob - old[i:i + 1, j])
            loss = torch.mean(torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - 2e-4, 1 + 2e-4))) / (n * len(window))
            loss.backward()
            total += loss.item()
    theirs = torch.cat([local_shard(p.grad).flatten() for p in policy.trainable])
    ours = torch.cat([g.flatten() for g in grads[0]])
    assert len(grads) == 1 and theirs.norm() > 0
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-5, atol=1e-7)
    assert metrics["train/mix_loss"] == pytest.approx(total, rel=1e-6)
    assert metrics["train/mix_num_timesteps"] == 3 and metrics["train/mix_window_start"] == 3


# -- the recipes ----------------------------------------------------------------------------------------
def test_the_flux_recipe_holds_the_authors_script_s_values():
    from hpcnft.distributed.config import check_layout

    c = load_config("flux1dev_pickscore_mixgrpo")
    r, m, t, o = c.rollout, c.mixgrpo, c.train, c.optim
    assert (c.algo.name, c.models.family, c.steps, c.checkpoint.every) == ("mixgrpo", "flux", 300, 50)
    assert (r.prompts_per_step, r.samples_per_prompt, r.num_steps, r.guidance_scale, r.height, r.width,
            r.integer_timesteps) == (32, 12, 25, 3.5, 720, 720, True)
    assert (m.noise_level, m.window_size, m.window_every, m.window_stride, m.window_roll_back, m.clip_range,
            m.adv_clip_max, m.updates_per_step) == (0.7, 4, 25, 1, True, 1e-4, 5.0, 4)
    assert (t.finetune, t.precision, t.grad_checkpointing) == ("full", "bf16", True)
    assert (o.lr, o.weight_decay, o.grad_clip) == (1e-5, 1e-4, 1.0)
    check_layout(c, 3)  # 192 samples a train rank, 48 an update
    s = load_config("sd35m_pickscore_mixgrpo")
    assert (s.models.family, s.samples_per_step, s.rollout.num_steps, s.mixgrpo, s.optim.lr) == (
        "sd3", 384, 25, m, 1e-5)


@pytest.mark.parametrize("change, key", [("rollout.samples_per_prompt=1", "rollout.samples_per_prompt"),
                                         ("rollout.solver=dpm2", "rollout.solver"),
                                         ("perf.old_pass_batch=4", "perf.old_pass_batch"),
                                         ("rollout.num_steps=2", "rollout.num_steps"),
                                         ("mixgrpo.updates_per_step=3", "mixgrpo.updates_per_step"),
                                         ("nft.beta=0.5", "nft.beta"), ("grpo.noise_level=0.5", "grpo.noise_level")])
def test_what_mixgrpo_cannot_run_is_refused_in_one_line(change, key):
    from hpcnft.common.errors import ConfigError

    with pytest.raises(ConfigError, match=f"^{key}: "):
        load_config("tiny_learns_mixgrpo", [change])
