"""Flow-GRPO's math and train step against the authors' own functions (tests/flow_grpo_reference.py,
copied from yifan123/flow_grpo and NVlabs/DiffusionNFT), on the tiny SD3.5 DiT with the same
inputs: one SDE transition and its log-probability (rollout and training forms), the rollout's
states and log-probabilities over a whole trajectory with and without CFG, the per-prompt
advantages, the clipped loss with its KL term, and one update's gradient through the trainer
(FSDP2 over one rank, LoRA, CFG, the KL reference). Also which update each sample trains in."""
from __future__ import annotations

import os

import pytest
import torch

import flow_grpo_reference as ref
from hpcnft.algo.flow_grpo import formulas as grpo
from hpcnft.algo.flow_grpo.sampler import sde_sample
from hpcnft.algo.root_config import load_config
from hpcnft.algo.sampler import Conditioning, null_autocast, sigma_grid

NOISE_LEVEL = 0.7


@pytest.fixture(scope="module")
def tiny_dit(tiny_models):
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    sd3 = tiny_models[0]
    transformer = SD3Transformer2DModel.from_pretrained(os.path.join(sd3, "transformer")).eval()
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(os.path.join(sd3, "scheduler"))
    return transformer, scheduler


def authors_scheduler(scheduler, num_steps: int):
    """The pipeline's scheduler with its timesteps set, as pipeline_with_logprob leaves it."""
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import retrieve_timesteps

    sched = type(scheduler).from_config(scheduler.config)
    retrieve_timesteps(sched, num_steps, "cpu", sigmas=None)
    return sched


def randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_the_grid_is_the_authors_scheduler_sigmas(tiny_dit):
    _, scheduler = tiny_dit
    assert torch.equal(sigma_grid(scheduler, 10), authors_scheduler(scheduler, 10).sigmas.float())


# -- one transition ---------------------------------------------------------------------------
def test_a_rollout_transition_equals_the_authors_at_every_step(tiny_dit):
    """sde_step_with_logprob as the pipeline calls it (one timestep, noise from a generator) and
    hpcnft's sde_step with the same noise: the same bits, sigma = 1's step included."""
    sched = authors_scheduler(tiny_dit[1], 10)
    sigmas = sigma_grid(tiny_dit[1], 10)
    assert sigmas[0] == 1.0  # the first step takes the sigma_max branch
    for k, t in enumerate(sched.timesteps):
        x, v = randn(3, 16, 8, 8, seed=k), randn(3, 16, 8, 8, seed=100 + k)
        theirs = ref.sde_step_with_logprob(sched, v, t.unsqueeze(0), x, noise_level=NOISE_LEVEL,
                                           generator=torch.Generator().manual_seed(7))
        noise = torch.randn(v.shape, generator=torch.Generator().manual_seed(7))
        ours = grpo.sde_step(x, v, sigmas[k], sigmas[k + 1], sigmas[1].item(), NOISE_LEVEL, noise=noise)
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b), k


def test_a_trained_transition_with_per_sample_sigmas_equals_the_authors(tiny_dit):
    """compute_log_prob's form: each sample at its own timestep, prev_sample given."""
    sched = authors_scheduler(tiny_dit[1], 10)
    sigmas = sigma_grid(tiny_dit[1], 10)
    steps = torch.tensor([0, 3, 8, 9])
    x, v, prev = (randn(4, 16, 8, 8, seed=s) for s in (1, 2, 3))
    theirs = ref.sde_step_with_logprob(sched, v, sched.timesteps[steps], x, noise_level=NOISE_LEVEL, prev_sample=prev)
    ours = grpo.sde_step(x, v, sigmas[steps], sigmas[steps + 1], sigmas[1].item(), NOISE_LEVEL, prev_sample=prev)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    assert ours[1].shape == (4,) and torch.isfinite(ours[1]).all()


def test_the_diffusionnft_copy_of_the_step_agrees_too(tiny_dit):
    sigmas = sigma_grid(tiny_dit[1], 10)
    x, v, prev = (randn(2, 16, 8, 8, seed=s) for s in (4, 5, 6))
    for k in range(10):
        _, _, log_prob = ref.flow_grpo_step(v, x, NOISE_LEVEL, sigmas, k, prev)
        assert torch.equal(grpo.sde_step(x, v, sigmas[k], sigmas[k + 1], sigmas[1].item(), NOISE_LEVEL,
                                         prev_sample=prev)[1], log_prob)


# -- a whole rollout on the tiny DiT ----------------------------------------------------------
@pytest.mark.parametrize("guidance", [1.0, 4.5])
def test_the_rollout_s_states_and_log_probabilities_equal_the_authors_pipeline(tiny_dit, guidance):
    """The pipeline's denoising loop (CFG as it does it at guidance 4.5) and hpcnft's SDE sampler
    from the same initial latents and transition noise."""
    transformer, scheduler = tiny_dit
    n, steps = 3, 10
    x0 = randn(n, 16, 8, 8, seed=11)
    pe, pooled = randn(n, 6, transformer.config.joint_attention_dim, seed=12), randn(n, 64, seed=13)
    neg_pe, neg_pooled = randn(1, 6, transformer.config.joint_attention_dim, seed=14), randn(1, 64, seed=15)
    cfg = guidance > 1.0
    g = torch.Generator().manual_seed(21)
    noise = torch.stack([torch.randn((n, 16, 8, 8), generator=g) for _ in range(steps)], dim=1)  # the loop's draws
    with torch.no_grad():
        _, their_states, their_log_probs = ref.denoising_loop(
            transformer, authors_scheduler(scheduler, steps), x0,
            torch.cat([neg_pe.expand(n, -1, -1), pe]) if cfg else pe,
            torch.cat([neg_pooled.expand(n, -1), pooled]) if cfg else pooled,
            cfg, guidance, NOISE_LEVEL, torch.Generator().manual_seed(21))
    cond = Conditioning(pe, pooled, neg_pe.expand(n, -1, -1), neg_pooled.expand(n, -1))
    last, states, log_probs = sde_sample(transformer, x0, noise, sigma_grid(scheduler, steps), cond, guidance,
                                         torch.float32, null_autocast, NOISE_LEVEL, keep=9)
    their_states = torch.stack(their_states, dim=1)
    assert torch.equal(states, their_states[:, :10]) and torch.equal(last, their_states[:, -1])
    assert torch.equal(log_probs, torch.stack(their_log_probs, dim=1))
    assert log_probs.shape == (n, steps)


# -- advantages and the loss ------------------------------------------------------------------
PROMPTS = ["a cat", "a dog", "a cat", "a fox", "a dog", "a cat", "a fox", "a fox"]
REWARDS = [0.31, 0.12, 0.47, 0.05, 0.26, 0.18, 0.44, 0.09]


@pytest.mark.parametrize("global_std", [True, False])
def test_group_advantages_equal_the_per_prompt_stat_tracker(global_std):
    want = ref.PerPromptStatTracker(global_std).update(PROMPTS, torch.tensor(REWARDS).numpy())
    got = grpo.group_advantages(torch.tensor(REWARDS), PROMPTS, global_std)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.from_numpy(want), rtol=1e-13, atol=1e-15)
    assert not torch.allclose(got, grpo.group_advantages(torch.tensor(REWARDS), PROMPTS, not global_std))


@pytest.mark.parametrize("per_prompt", [1, 2])
def test_the_step_s_advantages_are_the_authors_with_one_sample_per_prompt_too(per_prompt):
    """FlowGRPO.train_batch's advantages against train_sd3.py's: per prompt text with several
    samples a prompt, over the whole step with one (where per-prompt groups would all be 0)."""
    from dataclasses import dataclass

    from hpcnft.algo.flow_grpo.algorithm import FlowGRPO

    n = 8
    cfg = load_config("tiny_learns_grpo", [f"rollout.prompts_per_step={n // per_prompt}",
                                           f"rollout.samples_per_prompt={per_prompt}", "rollout.batch_size=4"])
    prompts = [f"p{i // per_prompt}" for i in range(n)]
    rewards = torch.tensor(REWARDS[:n], dtype=torch.float32)

    @dataclass
    class Rollout:  # the part of the engine's rollout a train batch is made of
        x0 = torch.zeros(4, 1)
        prompt_embeds = torch.zeros(4, 1)
        pooled = torch.zeros(4, 1)
        kept = [(torch.zeros(4, 2), torch.zeros(4, 1), None)]
    batch = FlowGRPO(cfg).train_batch(1, Rollout(), rewards, prompts, range(0, n))
    want = ref.advantages_of(prompts, rewards.numpy(), per_prompt, cfg.grpo.global_std)
    torch.testing.assert_close(batch.adv, torch.as_tensor(want), rtol=1e-13, atol=1e-15)  # numpy's sums round apart
    assert batch.adv.abs().sum() > 0


def test_kept_per_update_counts_each_update_s_samples_of_advantage_not_zero():
    adv = torch.tensor([0.5, 0.0, -1.0, 0.0, 0.0, 2.0, 0.0, 0.0], dtype=torch.float64)
    update = grpo.update_of(list(range(8)), 2, 1234, 3)
    kept = grpo.kept_per_update(adv, 2, 1234, 3)
    assert kept == [sum(1 for i in range(8) if update[i] == u and adv[i] != 0) for u in (0, 1)] and sum(kept) == 3


def test_group_advantages_refuse_a_prompt_list_of_another_length():
    with pytest.raises(ValueError, match="7 prompts for 8 rewards"):
        grpo.group_advantages(torch.tensor(REWARDS), PROMPTS[:7])


@pytest.mark.parametrize("kl_beta", [0.0, 0.04])
def test_the_clipped_loss_and_kl_equal_the_authors(kl_beta):
    """Ratios inside and outside [1 - eps, 1 + eps] on both sides, advantages beyond +-C."""
    n, eps, clip = 64, 0.01, 2.0
    old = randn(n, seed=1) - 3.0
    log_prob = old + randn(n, seed=2) * 0.02  # ratios around 1 +- 2 %
    adv = (randn(n, seed=3) * 2.0).double()
    mean, mean_ref = randn(n, 4, 3, 3, seed=4), randn(n, 4, 3, 3, seed=5)
    std = torch.rand(n, 1, 1, 1, generator=torch.Generator().manual_seed(6)) + 0.1
    loss, ratio = grpo.clipped_loss(log_prob, old, adv, eps, clip)
    kl = grpo.kl_to_reference(mean, mean_ref, std)
    ours = loss.mean() + kl_beta * kl.mean() if kl_beta else loss.mean()
    theirs, policy_loss, kl_loss, _, clipfrac = ref.grpo_loss(log_prob, old, adv, clip, eps, kl_beta, mean,
                                                              mean_ref, std)
    torch.testing.assert_close(ours, theirs, rtol=1e-14, atol=0)
    assert torch.equal(loss.mean(), policy_loss)
    if kl_beta:
        torch.testing.assert_close(kl.mean(), kl_loss, rtol=1e-6, atol=0)
    clipped = ((ratio - 1).abs() > eps).float().mean()
    assert 0.2 < clipped < 0.9 and torch.equal(clipped, clipfrac)  # both branches of the max are taken
    assert (adv.abs() > clip).any()


def test_a_ratio_of_one_gives_minus_the_advantage():
    adv = torch.tensor([1.0, -0.5, 7.0], dtype=torch.float64)
    loss, ratio = grpo.clipped_loss(torch.zeros(3), torch.zeros(3), adv, 1e-4, 5.0)
    assert torch.equal(ratio, torch.ones(3)) and loss.tolist() == [-1.0, 0.5, -5.0]


# -- which update a sample trains in ----------------------------------------------------------
def test_each_block_of_u_samples_gives_one_to_each_update():
    assign = grpo.update_of(list(range(64)), 4, seed=1234, step=3)
    for b in range(16):
        assert sorted(assign[4 * b:4 * b + 4]) == [0, 1, 2, 3]
    assert assign != grpo.update_of(list(range(64)), 4, seed=1234, step=4)  # drawn afresh every step
    assert assign[::4] != [assign[0]] * 16  # not the same order in every block


def test_a_rank_s_share_gets_the_same_updates_as_in_the_whole_step():
    """Layout-free: the samples 16..31 of a rank are assigned as in the list of all 64."""
    whole = grpo.update_of(list(range(64)), 2, seed=5, step=1)
    assert grpo.update_of(list(range(16, 32)), 2, seed=5, step=1) == whole[16:32]
    assert grpo.update_of(list(range(8)), 1, seed=5, step=1) == [0] * 8


# -- one update through the trainer against the authors' training loop ------------------------
@pytest.fixture
def world_one(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("adv, drop", [([1.3, -0.4, 6.0, -2.2], False), ([1.3, 0.0, 6.0, 0.0], True)],
                         ids=["every-sample", "drop-zero-advantage"])
def test_one_update_s_loss_and_gradient_equal_the_authors_training_loop(tiny_dit, world_one, adv, drop):
    """GRPOTrainer.step (one update of 4 samples x K = 9 transitions, micro-batches of 4 pairs,
    LoRA under FSDP2, CFG 4.5, KL 0.04 to the base) against compute_log_prob and the loss of
    train_sd3.py's loop (a batch of the 4 samples per timestep, the gradient accumulated over the
    9 timesteps: accelerate divides each by 9), on the same weights: loss, clip fraction and
    gradient equal to rounding. The old log-probabilities are the rollout's moved by up to 4e-4,
    so that some ratios leave the clip range. With grpo.drop_zero_advantage, the authors' loop
    runs on the samples their mask keeps (advantage not 0) and hpcnft's weights the others 0."""
    from diffusers import SD3Transformer2DModel
    from torch.distributed.device_mesh import init_device_mesh

    from hpcnft.algo.flow_grpo.trainer import GRPOBatch, GRPOTrainer
    from hpcnft.algo.policy import Policy
    from hpcnft.common.tensors import local_shard

    transformer, scheduler = tiny_dit
    cfg = load_config("tiny", ["algo.name=flow_grpo", "rollout.guidance_scale=4.5", "grpo.kl_beta=0.04",
                               "grpo.updates_per_step=1", "grpo.clip_range=2e-4", "train.micro_batch=4",
                               f"grpo.drop_zero_advantage={str(drop).lower()}"])
    policy = Policy(cfg, SD3Transformer2DModel.from_config(transformer.config), torch.device("cpu"),
                    init_device_mesh("cpu", (1,)))
    with torch.no_grad():  # LoRA B away from 0, so that the base and the policy differ (the KL term)
        for p in policy.trainable:
            local_shard(p).add_(randn(*local_shard(p).shape, seed=p.numel()) * 0.02)
    trainer = GRPOTrainer(cfg, policy, None, 1)
    n, k, steps = 4, 9, 10
    dim = transformer.config.joint_attention_dim
    pe, pooled = randn(n, 6, dim, seed=31), randn(n, 64, seed=32)
    neg_pe, neg_pooled = randn(1, 6, dim, seed=33), randn(1, 64, seed=34)
    sigmas = sigma_grid(scheduler, steps)
    cond = Conditioning(pe, pooled, neg_pe.expand(n, -1, -1), neg_pooled.expand(n, -1))
    _, states, log_probs = sde_sample(policy.transformer, randn(n, 16, 8, 8, seed=35),
                                      randn(n, steps, 16, 8, 8, seed=36), sigmas, cond, 4.5, torch.float32,
                                      policy.autocast, NOISE_LEVEL, keep=steps)
    old = log_probs + (torch.rand(n, steps, generator=torch.Generator().manual_seed(37)) - 0.5) * 8e-4
    adv = torch.tensor(adv, dtype=torch.float64)
    kept = grpo.kept_per_update(adv, 1, cfg.train.seed, 1) if drop else None
    assert kept in (None, [2])
    batch = GRPOBatch(states[:, :k + 1], old[:, :k], pe, pooled, neg_pe, neg_pooled, adv, list(range(n)), n, kept)
    grads = []

    def keep_grads(update):
        grads.append([local_shard(p.grad).clone() for p in policy.trainable])
        return 0.0, False
    trainer._optimizer_step = keep_grads
    metrics = trainer.step(batch, sigmas, step=1)

    # the authors' loop on the same weights
    sched = authors_scheduler(scheduler, steps)
    sample = {"latents": states[:, :-1], "next_latents": states[:, 1:], "log_probs": old,
              "timesteps": sched.timesteps.repeat(n, 1), "advantages": adv.unsqueeze(1).repeat(1, k),
              "prompt_embeds": pe, "pooled_prompt_embeds": pooled}
    if drop:  # train_sd3.py: samples = {k: v[mask]} with mask = advantages.abs().sum(dim=1) != 0
        mask = sample["advantages"].abs().sum(dim=1) != 0
        sample = {key: v[mask] for key, v in sample.items()}
    pe, pooled, n = sample.pop("prompt_embeds"), sample.pop("pooled_prompt_embeds"), len(sample["latents"])
    embeds, pooled_embeds = torch.cat([neg_pe.expand(n, -1, -1), pe]), torch.cat([neg_pooled.expand(n, -1), pooled])
    for p in policy.trainable:
        p.grad = None
    losses, clipfracs = [], []
    for j in range(k):
        _, log_prob, mean, std = ref.compute_log_prob(policy.transformer, sched, sample, j, embeds, pooled_embeds,
                                                      True, 4.5, NOISE_LEVEL)
        with torch.no_grad():
            policy.transformer.disable_adapters()
            _, _, mean_ref, _ = ref.compute_log_prob(policy.transformer, sched, sample, j, embeds, pooled_embeds,
                                                     True, 4.5, NOISE_LEVEL)
            policy.transformer.enable_adapters()
        loss, policy_loss, _, _, clipfrac = ref.grpo_loss(log_prob, sample["log_probs"][:, j],
                                                          sample["advantages"][:, j], 5.0, 2e-4, 0.04, mean, mean_ref,
                                                          std)
        (loss / k).backward()
        losses.append(policy_loss.item())
        clipfracs.append(clipfrac.item())
    theirs = [local_shard(p.grad) for p in policy.trainable]
    assert len(grads) == 1 and len(theirs) == len(grads[0]) > 0
    flat = lambda gs: torch.cat([g.flatten() for g in gs])  # noqa: E731
    assert flat(theirs).norm() > 0
    torch.testing.assert_close(flat(grads[0]), flat(theirs), rtol=1e-5, atol=1e-7)
    assert metrics["train/grpo_loss"] == pytest.approx(sum(losses) / k, rel=1e-6)
    assert metrics["train/grpo_clipfrac"] == pytest.approx(sum(clipfracs) / k, abs=1e-12)
    assert 0 < metrics["train/grpo_clipfrac"] < 1 and metrics["train/kl_loss"] > 0
    assert metrics["train/grpo_num_timesteps"] == k
