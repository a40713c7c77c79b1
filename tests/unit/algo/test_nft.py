"""NFT math of hpcnft.algo.nft.formulas against hand-computed cases and nft_spec.md §1.2-1.11.

Every expected value below is derived by hand (or from the spec's formulas and tables), never
copied from a run of the code under test.
"""
from __future__ import annotations

import hashlib
import math

import pytest
import torch

from hpcnft.algo import shared_math
from hpcnft.algo.nft import formulas as nft
from hpcnft.algo.root_config import load_config
from hpcnft.models.families.sd3 import dit_timestep
from hpcnft.algo.sampler import sigma_grid, velocity

C = 5.0  # adv_clip_max of the recipe


def blake63(*parts) -> int:
    """The spec's stable hash (§1.4), written out independently: blake2b-64 of the ':'-joined
    parts, masked to 63 bits (little-endian, as hpcnft.common.determinism documents)."""
    d = hashlib.blake2b(":".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(d, "little") & ((1 << 63) - 1)


# ---------------------------------------------------------------------------------------------
# §1.2 advantages
# ---------------------------------------------------------------------------------------------
# P = 2 prompts, G = 3 samples each. Group means 2 and 6; deviations -1, 0, 1, -2, 0, 2.
# Global mean 24/6 = 4; squared deviations from it 9, 4, 1, 0, 4, 16 -> sum 34.
REWARDS = [1.0, 2.0, 3.0, 4.0, 6.0, 8.0]
DEVIATIONS = [-1.0, 0.0, 1.0, -2.0, 0.0, 2.0]
STD_UNBIASED = math.sqrt(34 / 5)  # torch.std, N-1 (miles)
STD_POPULATION = math.sqrt(34 / 6)  # np.std, N (official)


@pytest.mark.parametrize("estimator, std", [("unbiased", STD_UNBIASED), ("population", STD_POPULATION)])
def test_advantages_hand_case(estimator, std):
    a = nft.advantages(torch.tensor(REWARDS), group_size=3, std_estimator=estimator)
    expected = torch.tensor([d / (std + 1e-4) for d in DEVIATIONS], dtype=torch.float64)
    assert a.shape == (6,)
    assert torch.allclose(a.double(), expected, rtol=0, atol=1e-12), (a, expected)


def test_advantages_epsilon_is_added_to_the_std():
    # Constant rewards: std 0, so A = 0 / (0 + 1e-4) = 0 (no division by zero) ...
    a = nft.advantages(torch.full((6,), 0.7), group_size=3)
    assert torch.all(a == 0) and torch.isfinite(a).all()
    # ... and a tiny spread shows the +1e-4: deviations +-1e-4 in one group, other group constant.
    r = torch.tensor([0.5 - 1e-4, 0.5, 0.5 + 1e-4, 0.5, 0.5, 0.5], dtype=torch.float64)
    std = math.sqrt(2e-8 / 6)  # population: mean 0.5, squared deviations sum 2e-8
    a = nft.advantages(r, group_size=3, std_estimator="population")
    assert a[2].item() == pytest.approx(1e-4 / (std + 1e-4), rel=1e-9)
    assert a[2].item() != pytest.approx(1e-4 / std, rel=1e-3)  # the epsilon really is there


def test_advantages_use_the_per_prompt_mean_and_the_global_std():
    a = nft.advantages(torch.tensor(REWARDS), group_size=3)
    # per-prompt mean: every group sums to zero
    assert abs(a[:3].sum().item()) < 1e-12 and abs(a[3:].sum().item()) < 1e-12
    # global std: the same scale for both groups, so A is proportional to the raw deviation
    # (a per-group std would give both groups' extremes the same |A|)
    assert a[5].item() == pytest.approx(2 * a[2].item(), rel=1e-12)
    assert a[2].item() != pytest.approx(abs(a[3].item()), rel=1e-3)


def test_advantages_unbiased_and_population_differ_by_the_std_ratio():
    r = torch.tensor(REWARDS)
    a_u = nft.advantages(r, 3, "unbiased")
    a_p = nft.advantages(r, 3, "population")
    ratio = (STD_POPULATION + 1e-4) / (STD_UNBIASED + 1e-4)
    assert torch.allclose(a_u.double(), a_p.double() * ratio, rtol=1e-12, atol=0)
    assert ratio < 1  # miles' advantages are the smaller ones (§1.2)


# ---------------------------------------------------------------------------------------------
# §1.3 optimality probability r
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("a, r", [(-5.0, 0.0), (0.0, 0.5), (5.0, 1.0), (2.5, 0.75), (-1.0, 0.4),
                                  (7.0, 1.0), (-12.0, 0.0), (1e9, 1.0)])
def test_optimality_r_hand_values_and_clipping(a, r):
    out = nft.optimality_r(torch.tensor([a], dtype=torch.float64), C)
    assert out.item() == pytest.approx(r, abs=1e-15)


def test_optimality_r_stays_in_the_unit_interval():
    a = torch.linspace(-50, 50, 1001, dtype=torch.float64)
    r = nft.optimality_r(a, C)
    assert r.min().item() == 0.0 and r.max().item() == 1.0
    assert torch.all(r[1:] >= r[:-1])  # monotone


def test_mean_r_of_zero_mean_groups_is_one_half():
    g = torch.Generator().manual_seed(7)
    rewards = 0.6 + 0.3 * torch.rand(64, generator=g, dtype=torch.float64)  # P = G = 8
    a = nft.advantages(rewards, group_size=8)
    assert a.abs().max().item() < C  # no clipping, so r is linear in A
    r = nft.optimality_r(a, C)
    assert abs(r.mean().item() - 0.5) < 1e-6


# ---------------------------------------------------------------------------------------------
# §1.4 trained sigmas and the sigma grid
# ---------------------------------------------------------------------------------------------
def test_k_is_nine():
    cfg = load_config("tiny")
    assert (cfg.rollout.num_steps, cfg.nft.timestep_fraction, cfg.trained_steps) == (10, 0.99, 9)


def test_first_strategy_is_a_seeded_permutation_of_the_first_nine():
    perms = [nft.trained_sigma_indices(10, 9, "first", True, 1234, i) for i in range(20)]
    for p in perms:
        assert sorted(p) == list(range(9))  # sigma_0..sigma_8; sigma_9 never trained
        assert 9 not in p
    # reproducible
    assert perms == [nft.trained_sigma_indices(10, 9, "first", True, 1234, i) for i in range(20)]
    # differs between samples (20 identical permutations of 9 would mean no per-sample seeding)
    assert len({tuple(p) for p in perms}) > 1
    assert perms[0] != perms[1] or perms[1] != perms[2]
    # and between seeds
    other = [nft.trained_sigma_indices(10, 9, "first", True, 4321, i) for i in range(20)]
    assert other != perms


def test_first_strategy_seeding_follows_the_spec():
    # §1.4: torch.randperm(9) with a generator seeded stable_hash("nft_sigma_shuffle", seed, index)
    for index in (0, 5, 123456):
        g = torch.Generator().manual_seed(blake63("nft_sigma_shuffle", 1234, index))
        assert nft.trained_sigma_indices(10, 9, "first", True, 1234, index) == \
            torch.randperm(9, generator=g).tolist()


def test_first_strategy_without_shuffle_is_in_order():
    for i in (0, 1, 99):
        assert nft.trained_sigma_indices(10, 9, "first", False, 1234, i) == [0, 1, 2, 3, 4, 5, 6, 7, 8]


def test_drop_random_drops_one_random_sigma_per_sample():
    dropped = []
    for i in range(200):
        p = nft.trained_sigma_indices(10, 9, "drop_random", True, 1234, i)
        assert len(p) == 9 and len(set(p)) == 9 and set(p) <= set(range(10))
        dropped.append((set(range(10)) - set(p)).pop())
        assert p == nft.trained_sigma_indices(10, 9, "drop_random", True, 1234, i)  # seeded
    assert 9 in dropped  # sigma_9 can be dropped ...
    assert any(d != 9 for d in dropped)  # ... or kept
    assert len(set(dropped)) > 2


# nft_spec.md §1.4 table, and the note under it for diffusers 0.42.1 (sigma_1..sigma_4).
SIGMA_TABLE = [1.0, 0.96012926, 0.91334891, 0.85769236, 0.79036838, 0.70727849, 0.60215056, 0.46487603,
               0.27804878, 0.00892857, 0.0]
SIGMA_DIFFUSERS_0421 = [1.0, 0.96012932, 0.91334897, 0.85769230, 0.79036826] + SIGMA_TABLE[5:]
TIMESTEP_TABLE = [1000.0, 960.12927, 913.34894, 857.69238, 790.36841, 707.27850, 602.15057, 464.87604,
                  278.04880, 8.92857, 0.0]


@pytest.fixture(scope="module")
def grid() -> torch.Tensor:
    from diffusers import FlowMatchEulerDiscreteScheduler

    return sigma_grid(FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0), 10)


def test_sigma_grid_shape_and_terminal_zero(grid):
    assert grid.dtype == torch.float32
    assert grid.shape == (11,)
    assert grid[-1].item() == 0.0 and grid[0].item() == 1.0
    assert torch.all(grid[1:] < grid[:-1])


def test_sigma_grid_matches_the_spec_table(grid):
    # pinned to what diffusers 0.42.1 computes (the note under the table) at 1e-7
    for k, (got, want) in enumerate(zip(grid.tolist(), SIGMA_DIFFUSERS_0421)):
        assert abs(got - want) <= 1e-7, (k, got, want)
    # cross-check with the table itself: 1e-7 everywhere except sigma_1..sigma_4, where the table
    # is off in the 8th digit (sigma_4 by 1.2e-7 = 2 float32 ulps; see the report)
    for k, (got, want) in enumerate(zip(grid.tolist(), SIGMA_TABLE)):
        tol = 1.5e-7 if 1 <= k <= 4 else 1e-7
        assert abs(got - want) <= tol, (k, got, want)


def test_sigma_grid_matches_the_spec_construction(grid):
    # §1.4 in words: linspace(1000 s_max, 1000 s_min) of the shifted 1000-step table, /1000,
    # shift again (3s / (1 + 2s)), append 0. Done here in float64.
    def shift(s):
        return 3 * s / (1 + 2 * s)

    s_max, s_min = shift(1.0), shift(1 / 1000)
    ts = [1000 * s_max + (1000 * s_min - 1000 * s_max) * k / 9 for k in range(10)]
    expected = [shift(t / 1000) for t in ts] + [0.0]
    assert s_min == pytest.approx(0.002994, abs=1e-6)
    for got, want in zip(grid.tolist(), expected):
        assert abs(got - want) < 2e-7


def test_sigma_grid_mean_of_the_trained_sigmas(grid):
    assert abs(grid[:9].double().mean().item() - 0.7304325) < 1e-6  # nft_t_mean, miles rule
    assert abs(grid[:10].double().mean().item() - 0.6582821) < 1e-6  # expectation, random drop


def test_dit_timestep_column_of_the_table(grid):
    tau = dit_timestep(grid)
    assert tau.dtype == torch.float32
    assert torch.equal(tau, grid.to(torch.float32) * 1000.0)
    for got, want in zip(tau.tolist(), TIMESTEP_TABLE):
        assert abs(got - want) < 2e-4


# ---------------------------------------------------------------------------------------------
# §1.5 corruption, §1.6 DiT timestep
# ---------------------------------------------------------------------------------------------
def test_corrupt_hand_case():
    x0 = torch.tensor([2.0, -1.0, 3.0, 0.5], dtype=torch.float64).view(2, 1, 1, 2)
    eps = torch.tensor([0.0, 4.0, -1.0, 1.0], dtype=torch.float64).view(2, 1, 1, 2)
    sigma = torch.tensor([0.25, 1.0])
    x = nft.corrupt(x0, sigma, eps)
    assert x.dtype == torch.float32
    # sample 0: 0.75 * (2, -1) + 0.25 * (0, 4) = (1.5, 0.25); sample 1 at sigma 1: pure noise
    assert torch.equal(x.view(2, 2), torch.tensor([[1.5, 0.25], [-1.0, 1.0]]))


def test_corrupt_at_sigma_zero_is_the_data():
    x0 = torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    eps = torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(nft.corrupt(x0, torch.zeros(3), eps), x0)


def test_dit_timestep_is_sigma_times_1000_in_float32():
    tau = dit_timestep(torch.tensor([0.5]))
    assert tau.dtype == torch.float32 and tau.item() == 500.0
    s = torch.tensor([0.27804878, 0.00892857], dtype=torch.float64)
    assert torch.equal(dit_timestep(s), s.to(torch.float32) * 1000.0)  # fp32 multiply, not truncated
    assert dit_timestep(s)[1].item() != 8.0


def test_the_velocity_the_trainer_uses_feeds_1000_sigma_to_the_dit():
    from diffusers import SD3Transformer2DModel

    from hpcnft.models.tiny import TINY_TRANSFORMER

    dit = SD3Transformer2DModel(**TINY_TRANSFORMER)
    seen = {}
    dit.register_forward_pre_hook(lambda module, args, kwargs: seen.update(kwargs), with_kwargs=True)
    sigma = torch.tensor([0.5, 0.00892857])
    velocity(dit, torch.zeros(2, 16, 4, 4), sigma, torch.zeros(2, 3, 64), torch.zeros(2, 64), torch.float32)
    assert seen["timestep"].dtype == torch.float32
    assert torch.equal(seen["timestep"], torch.tensor([500.0, 0.00892857 * 1000.0], dtype=torch.float32))


# ---------------------------------------------------------------------------------------------
# §1.7 implicit policies, §1.8 branch losses, §1.9 pair loss
# ---------------------------------------------------------------------------------------------
def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_implicit_policies_beta_one():
    v_theta, v_old = _rand(3, 4, 2, 2, seed=1), _rand(3, 4, 2, 2, seed=2)
    v_pos, v_neg = nft.implicit_policies(v_theta, v_old, 1.0)
    assert torch.equal(v_pos, v_theta)
    assert torch.equal(v_neg, 2 * v_old - v_theta)


def test_implicit_policies_general_beta_hand_case():
    v_pos, v_neg = nft.implicit_policies(torch.tensor([2.0]), torch.tensor([1.0]), 0.5)
    assert v_pos.item() == pytest.approx(1.5)  # 0.5*2 + 0.5*1
    assert v_neg.item() == pytest.approx(0.5)  # 1.5*1 - 0.5*2 (reflection of v+ about v_old)


@pytest.mark.parametrize("adaptive", [True, False])
def test_branches_coincide_bit_for_bit_when_old_equals_theta(adaptive):
    x0, eps, v = _rand(4, 16, 8, 8, seed=3), _rand(4, 16, 8, 8, seed=4), _rand(4, 16, 8, 8, seed=5)
    sigma = torch.tensor([1.0, 0.7072785, 0.2780488, 0.0089286])
    x = nft.corrupt(x0, sigma, eps)
    v_pos, v_neg = nft.implicit_policies(v, v.clone(), 1.0)
    l_pos = nft.branch_loss(x, x0, sigma, v_pos, adaptive)
    l_neg = nft.branch_loss(x, x0, sigma, v_neg, adaptive)
    assert torch.equal(l_pos, l_neg)


def _branch_inputs(err):
    """x_sigma, x0, sigma, v such that x_sigma - sigma v - x0 == err (v = 0, x0 = 0)."""
    err = torch.tensor(err, dtype=torch.float32)
    n = err.shape[0]
    x = err.view(n, 1, 1, -1)
    return x, torch.zeros_like(x), torch.full((n,), 0.5), torch.zeros_like(x)


def test_branch_loss_adaptive_hand_case():
    # sample 0: err (1, 3): mse 5, w = mean|err| = 2 -> L = 2.5
    # sample 1: err (0.5, -1.5): mse 1.25, w = 1 -> L = 1.25
    # sample 2: err (1e-6, -1e-6): mse 1e-12, w = max(1e-6, 1e-5) = 1e-5 -> L = 1e-7
    x, x0, s, v = _branch_inputs([[1.0, 3.0], [0.5, -1.5], [1e-6, -1e-6]])
    l = nft.branch_loss(x, x0, s, v, adaptive=True)
    assert l.shape == (3,)
    assert l[0].item() == pytest.approx(2.5, rel=1e-6)
    assert l[1].item() == pytest.approx(1.25, rel=1e-6)
    assert l[2].item() == pytest.approx(1e-7, rel=1e-4)


def test_branch_loss_uses_x0_hat_from_sigma_and_v():
    # x0_hat = x_sigma - sigma v = 3 - 0.5 * 4 = 1; x0 = 0.5 -> err 0.5 everywhere: mse 0.25, w 0.5
    x = torch.full((1, 2, 2, 2), 3.0)
    l = nft.branch_loss(x, torch.full_like(x, 0.5), torch.tensor([0.5]), torch.full_like(x, 4.0), True)
    assert l.item() == pytest.approx(0.5, rel=1e-6)
    assert nft.branch_loss(x, torch.full_like(x, 0.5), torch.tensor([0.5]), torch.full_like(x, 4.0),
                           False).item() == pytest.approx(0.25, rel=1e-6)


def test_branch_loss_non_adaptive_is_plain_mse():
    x, x0, s, v = _branch_inputs([[1.0, 3.0], [0.5, -1.5], [1e-6, -1e-6]])
    l = nft.branch_loss(x, x0, s, v, adaptive=False)
    assert l[0].item() == pytest.approx(5.0, rel=1e-6)
    assert l[1].item() == pytest.approx(1.25, rel=1e-6)
    assert l[2].item() == pytest.approx(1e-12, rel=1e-4)


def test_adaptive_weight_carries_no_gradient():
    # L = mean(err^2) / w with w constant: dL/dv = -sigma * 2 err / (n w); err (1, 3), n 2, w 2
    x, x0, s, _ = _branch_inputs([[1.0, 3.0]])
    v = torch.zeros_like(x, requires_grad=True)
    nft.branch_loss(x, x0, s, v, adaptive=True).sum().backward()
    expected = torch.tensor([-0.5 * 2 * 1.0 / 4, -0.5 * 2 * 3.0 / 4]).view_as(x)
    assert torch.allclose(v.grad, expected, rtol=1e-6, atol=0)


def test_pair_loss_formula():
    l_pos = torch.tensor([0.4, 0.4, 0.4])
    l_neg = torch.tensor([0.2, 0.2, 0.2])
    r = torch.tensor([0.75, 0.0, 1.0], dtype=torch.float64)
    out = nft.pair_loss(l_pos, l_neg, r, C, 1.0)
    # 5 * (0.75*0.4 + 0.25*0.2) = 1.75 ; r = 0 -> 5 * 0.2 = 1 ; r = 1 -> 5 * 0.4 = 2
    assert torch.allclose(out, torch.tensor([1.75, 1.0, 2.0]), rtol=1e-6, atol=0)
    assert torch.allclose(nft.pair_loss(l_pos, l_neg, r, C, 2.0), torch.tensor([0.875, 0.5, 1.0]), rtol=1e-6)


def _sgd_step_on_pair_loss(r_value: float):
    """One SGD step on the NFT loss with pi_old == pi_theta; returns (mse before, mse after, grad)."""
    x0, eps = _rand(2, 4, 4, 4, seed=11), _rand(2, 4, 4, 4, seed=12)
    sigma = torch.tensor([0.7072785, 0.4648760])
    x = nft.corrupt(x0, sigma, eps)
    target = eps - x0  # the data velocity
    v_theta = (target + 0.5 * _rand(2, 4, 4, 4, seed=13)).requires_grad_(True)
    v_old = v_theta.detach()
    v_pos, v_neg = nft.implicit_policies(v_theta, v_old, 1.0)
    loss = nft.pair_loss(nft.branch_loss(x, x0, sigma, v_pos, True), nft.branch_loss(x, x0, sigma, v_neg, True),
                         torch.full((2,), r_value, dtype=torch.float64), C, 1.0).mean()
    loss.backward()
    before = (v_theta.detach() - target).square().mean().item()
    after = (v_theta.detach() - 1e-2 * v_theta.grad - target).square().mean().item()
    return before, after, v_theta.grad


def test_positive_advantage_pulls_v_theta_toward_the_data_velocity():
    before, after, grad = _sgd_step_on_pair_loss(1.0)
    assert grad.abs().max().item() > 0
    assert after < before


def test_negative_advantage_pushes_v_theta_away():
    before, after, _ = _sgd_step_on_pair_loss(0.0)
    assert after > before


def test_zero_advantage_gives_zero_gradient():
    _, _, grad = _sgd_step_on_pair_loss(0.5)
    assert grad.abs().max().item() <= 1e-12


def test_gradient_is_proportional_to_2r_minus_1():
    _, _, g1 = _sgd_step_on_pair_loss(1.0)
    _, _, g75 = _sgd_step_on_pair_loss(0.75)
    _, _, g0 = _sgd_step_on_pair_loss(0.0)
    assert torch.allclose(g75, 0.5 * g1, rtol=1e-5, atol=1e-12)  # 2*0.75-1 = 0.5
    assert torch.allclose(g0, -g1, rtol=1e-5, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# §2 EMA decay, §1.11 reward stats
# ---------------------------------------------------------------------------------------------
def test_ema_decay_recipe_law():
    assert nft.ema_decay(0, 0.001, 0.5) == 0.0  # flat decay (0) before any step
    assert nft.ema_decay(1, 0.001, 0.5) == pytest.approx(0.001)
    assert nft.ema_decay(100, 0.001, 0.5) == pytest.approx(0.1)
    assert nft.ema_decay(499, 0.001, 0.5) == pytest.approx(0.499)
    assert nft.ema_decay(500, 0.001, 0.5) == pytest.approx(0.5)
    assert nft.ema_decay(1000, 0.001, 0.5) == 0.5
    assert nft.ema_decay(10 ** 6, 0.001, 0.5) == 0.5


def test_ema_decay_flat_steps_decay_type_2():
    # official decay_type 2: 0 for s < 75, then min(0.0075 (s - 75), 0.999)
    assert nft.ema_decay(0, 0.0075, 0.999, flat_steps=75) == 0.0
    assert nft.ema_decay(75, 0.0075, 0.999, flat_steps=75) == 0.0
    assert nft.ema_decay(76, 0.0075, 0.999, flat_steps=75) == pytest.approx(0.0075)
    assert nft.ema_decay(10 ** 5, 0.0075, 0.999, flat_steps=75) == 0.999
    assert nft.ema_decay(3, 0.001, 0.5, flat_steps=5, flat_decay=0.3) == 0.3


def test_reward_stats_hand_case():
    s = shared_math.reward_stats(torch.tensor([0.1, 0.4, 0.2, 0.3], dtype=torch.float64))
    assert s["raw_mean"] == pytest.approx(0.25)
    # population std: squared deviations 0.0225, 0.0225, 0.0025, 0.0025 -> sqrt(0.05 / 4)
    assert s["raw_std"] == pytest.approx(math.sqrt(0.0125), rel=1e-12)
    assert s["raw_std"] != pytest.approx(math.sqrt(0.05 / 3), rel=1e-3)  # not the unbiased one
    assert s["raw_median"] == pytest.approx(0.2)  # lower middle of 0.1 0.2 0.3 0.4, not 0.25
    assert s["raw_min"] == pytest.approx(0.1) and s["raw_max"] == pytest.approx(0.4)
    assert s["raw_num_samples"] == 4.0


def test_reward_stats_median_odd_count():
    assert shared_math.reward_stats(torch.tensor([5.0, 1.0, 3.0]))["raw_median"] == 3.0


def test_the_branch_loss_squares_without_pow_bit_for_bit():
    """err * err instead of err.square(): pow's backward copies its exponent to the device at each
    call; the loss and its gradient keep their bits."""
    from hpcnft.algo.nft.formulas import _squared

    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 3, 8, 8, generator=g, requires_grad=True)
    y = x.detach().clone().requires_grad_(True)
    w = torch.randn(4, 3, 8, 8, generator=g)
    (_squared(x) * w).sum().backward()
    (y.square() * w).sum().backward()
    assert torch.equal(_squared(x), y.square()) and torch.equal(x.grad, y.grad)
    assert "Pow" not in type(_squared(x).grad_fn).__name__
