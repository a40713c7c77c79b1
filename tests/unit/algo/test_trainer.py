"""Pieces of hpcnft.algo.nft.trainer and algo.pairs that need no model: the fp16 loss scaler and the (sample, sigma)
pairs of a step (docs/architecture.md, "One training step"; nft_spec.md §1.4, §5)."""
from __future__ import annotations

import pytest
import torch

from hpcnft.algo.nft.pairs import pair_noise, train_sigma_pairs
from hpcnft.algo.root_config import load_config
from hpcnft.algo.train_base import LossScaler


# ---------------------------------------------------------------------------------------------
# LossScaler: torch.amp.GradScaler's rules, init 65536
# ---------------------------------------------------------------------------------------------
def test_loss_scaler_initial_scale():
    assert LossScaler(65536.0, enabled=True).scale == 65536.0
    assert LossScaler(65536.0, enabled=True).growth_tracker == 0


def test_overflow_halves_and_resets_the_growth_tracker():
    s = LossScaler(65536.0, enabled=True)
    for _ in range(5):
        s.update(found_inf=False)
    assert s.growth_tracker == 5 and s.scale == 65536.0
    s.update(found_inf=True)
    assert s.scale == 32768.0 and s.growth_tracker == 0
    s.update(found_inf=True)
    assert s.scale == 16384.0 and s.growth_tracker == 0


def test_2000_clean_steps_double_the_scale():
    s = LossScaler(65536.0, enabled=True)
    for _ in range(1999):
        s.update(found_inf=False)
    assert s.scale == 65536.0 and s.growth_tracker == 1999
    s.update(found_inf=False)
    assert s.scale == 131072.0 and s.growth_tracker == 0
    # an overflow in the middle restarts the count
    s.update(found_inf=True)  # 65536
    for _ in range(1000):
        s.update(found_inf=False)
    s.update(found_inf=True)  # 32768, tracker back to 0
    for _ in range(1999):
        s.update(found_inf=False)
    assert s.scale == 32768.0
    s.update(found_inf=False)
    assert s.scale == 65536.0


def test_disabled_scaler_stays_at_one():
    s = LossScaler(65536.0, enabled=False)
    assert s.scale == 1.0
    for found_inf in [True] * 3 + [False] * 2500:
        s.update(found_inf=found_inf)
    assert s.scale == 1.0


def test_loss_scaler_state_dict_round_trip():
    a = LossScaler(65536.0, enabled=True)
    a.update(found_inf=True)
    for _ in range(1234):
        a.update(found_inf=False)
    state = a.state_dict()
    b = LossScaler(65536.0, enabled=True)
    b.load_state_dict(state)
    assert (b.scale, b.growth_tracker) == (32768.0, 1234) == (a.scale, a.growth_tracker)
    for _ in range(766):  # both reach the 2000th clean step together
        a.update(found_inf=False)
        b.update(found_inf=False)
    assert a.scale == b.scale == 65536.0 and a.growth_tracker == b.growth_tracker == 0


# ---------------------------------------------------------------------------------------------
# train_sigma_pairs
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cfg():
    return load_config("tiny")  # 10 rollout steps, fraction 0.99 -> K = 9, strategy "first"


def test_k_pairs_per_sample_sample_major(cfg):
    ids = [3, 17, 40]
    pairs = train_sigma_pairs(cfg, ids, step=2)
    assert len(pairs) == 9 * len(ids)
    assert [p for p, _ in pairs] == [0] * 9 + [1] * 9 + [2] * 9  # positions into the list, sample-major
    for pos in range(3):
        sig = [j for p, j in pairs if p == pos]
        assert sorted(sig) == list(range(9))  # sigma_0..sigma_8, never the last step
    assert len({tuple(j for p, j in pairs if p == pos) for pos in range(3)}) > 1  # shuffled per sample


def test_pairs_of_a_sample_do_not_depend_on_the_other_samples(cfg):
    together = train_sigma_pairs(cfg, [3, 17, 40], step=5)
    alone = train_sigma_pairs(cfg, [17], step=5)
    assert [j for _, j in alone] == [j for p, j in together if p == 1]
    reordered = train_sigma_pairs(cfg, [40, 99, 17], step=5)
    assert [j for p, j in reordered if p == 2] == [j for _, j in alone]
    assert [j for p, j in reordered if p == 0] == [j for p, j in together if p == 2]


def test_pairs_are_reproducible_and_keyed_by_step_and_seed(cfg):
    ids = list(range(16))
    a = train_sigma_pairs(cfg, ids, step=1)
    assert a == train_sigma_pairs(cfg, ids, step=1)
    assert a != train_sigma_pairs(cfg, ids, step=2)
    other = load_config("tiny", ["train.seed=7"])
    assert a != train_sigma_pairs(other, ids, step=1)


def test_pairs_follow_the_strategy_settings():
    no_shuffle = load_config("tiny", ["nft.shuffle_timesteps=false"])
    assert train_sigma_pairs(no_shuffle, [5, 6], step=3) == [(p, j) for p in (0, 1) for j in range(9)]
    drop = load_config("tiny", ["nft.timestep_strategy=drop_random"])
    pairs = train_sigma_pairs(drop, list(range(40)), step=1)
    assert len(pairs) == 9 * 40
    dropped = {p: (set(range(10)) - {j for q, j in pairs if q == p}) for p in range(40)}
    assert all(len(d) == 1 for d in dropped.values())
    assert len({d.pop() for d in dropped.values()}) > 1


def test_pair_noise_is_keyed_by_sample_not_by_batch(cfg):
    a = pair_noise(cfg, 3, 17, 4, (16, 8, 8))
    assert a.shape == (16, 8, 8) and a.dtype == torch.float32
    assert torch.equal(a, pair_noise(cfg, 3, 17, 4, (16, 8, 8)))
    assert not torch.equal(a, pair_noise(cfg, 3, 17, 5, (16, 8, 8)))
    assert not torch.equal(a, pair_noise(cfg, 3, 18, 4, (16, 8, 8)))
    assert not torch.equal(a, pair_noise(cfg, 4, 17, 4, (16, 8, 8)))


def test_skipping_peft_input_cast_under_autocast_changes_nothing():
    """Policy turns off peft's cast of each activation to the fp32 LoRA dtype when it trains in
    half precision: under autocast the LoRA matmuls run in half precision either way, so the
    forward and every gradient are the same bits."""
    from lora_tools import tiny_lora_dit

    from hpcnft.models.tiny import TINY_TRANSFORMER
    from hpcnft.perf import levers

    tr = tiny_lora_dit(load_config("tiny"), base_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    c = TINY_TRANSFORMER
    inputs = dict(hidden_states=torch.randn(2, c["in_channels"], 8, 8, generator=g).bfloat16(),
                  timestep=torch.tensor([700.0, 200.0]),
                  encoder_hidden_states=torch.randn(2, 5, c["joint_attention_dim"], generator=g).bfloat16(),
                  pooled_projections=torch.randn(2, c["pooled_projection_dim"], generator=g).bfloat16())

    def run(cast: bool):
        for layer in levers.lora_layers(tr):
            layer.cast_input_dtype_enabled = cast
        tr.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = tr(**inputs, return_dict=False)[0]
        out.float().square().mean().backward()
        return out.detach(), [p.grad.clone() for p in tr.parameters() if p.requires_grad]

    out_cast, grads_cast = run(True)
    out_plain, grads_plain = run(False)
    assert torch.equal(out_cast, out_plain)
    assert all(torch.equal(a, b) for a, b in zip(grads_cast, grads_plain))


# ---------------------------------------------------------------------------------------------
# PairNoise: the step's pair noise, prefetched in a worker thread or drawn in line, same values
# ---------------------------------------------------------------------------------------------
def test_prefetched_pair_noise_is_drawn_in_a_worker_and_equals_the_inline_draw(thread_spy):
    from hpcnft.algo.nft import pairs as trainer_mod
    from hpcnft.algo.nft.pairs import PairNoise

    cfg = load_config("tiny", [])
    ids, shape, step = [4, 5, 6], (2, 4, 4), 3
    pairs = train_sigma_pairs(cfg, ids, step)
    inline = PairNoise(cfg).take(step, ids, pairs, shape)
    assert inline.shape == (len(pairs), *shape)
    for k, (p, j) in enumerate(pairs):
        assert torch.equal(inline[k], pair_noise(cfg, step, ids[p], j, shape))

    threads = thread_spy(trainer_mod, "pair_noise")
    noise = PairNoise(cfg)
    noise.prefetch(step, ids, shape, pin=False)
    got = noise.take(step, ids, pairs, shape)
    assert torch.equal(got, inline)
    assert threads and all(t.startswith("hpcnft-noise") for t in threads)


def test_pair_noise_prefetched_for_other_samples_is_not_used():
    from hpcnft.algo.nft.pairs import PairNoise

    cfg = load_config("tiny", [])
    shape = (2, 4, 4)
    noise = PairNoise(cfg)
    noise.prefetch(3, [0, 1], shape, pin=False)
    pairs = train_sigma_pairs(cfg, [2, 3], 3)
    got = noise.take(3, [2, 3], pairs, shape)  # another rank's samples, say: drawn afresh
    assert torch.equal(got, PairNoise(cfg).take(3, [2, 3], pairs, shape))
    noise.prefetch(3, [0, 1], shape, pin=False)
    assert not torch.equal(noise.take(4, [0, 1], train_sigma_pairs(cfg, [0, 1], 4), shape),
                           PairNoise(cfg).take(3, [0, 1], train_sigma_pairs(cfg, [0, 1], 3), shape))
