"""`algo.name` and the `[grpo]` section: the algorithms by name, the Flow-GRPO recipes' values,
and the refusals (one ConfigError naming the key): the other algorithm's keys, a noise level of 0
or below, the options that only DiffusionNFT's sampler or trainer has, updates that do not split
the samples."""
from __future__ import annotations

import dataclasses

import pytest

from hpcnft.algo.config import AlgoConfig, EMAConfig
from hpcnft.algo.registry import ALGORITHMS, algorithm_for, spec_of
from hpcnft.algo.flow_grpo.config import GRPOConfig
from hpcnft.algo.nft.config import NFTConfig
from hpcnft.algo.root_config import ConfigError, load_config
from hpcnft.distributed.config import check_layout


def test_every_algorithm_name_has_its_spec_section_and_implementation():
    choices = next(f for f in dataclasses.fields(AlgoConfig) if f.name == "name").metadata["choices"]
    assert tuple(ALGORITHMS) == tuple(choices) == ("nft", "flow_grpo", "mixgrpo")
    for name in ALGORITHMS:
        spec = spec_of(name)
        assert spec.name == name and isinstance(getattr(load_config("tiny"), spec.section), spec.config)
        assert spec.metric_keys[0] == spec.loss_key and spec.loss_key in spec.plot_keys
    assert algorithm_for(load_config("tiny")).spec is spec_of("nft")
    assert algorithm_for(load_config("tiny_learns_grpo")).spec is spec_of("flow_grpo")


def test_tiny_learns_grpo_is_tiny_learns_with_flow_grpo():
    grpo, nft = load_config("tiny_learns_grpo"), load_config("tiny_learns")
    assert grpo.algo.name == "flow_grpo" and nft.algo.name == "nft"
    assert dataclasses.replace(grpo, algo=nft.algo, grpo=nft.grpo) == nft  # nothing else differs
    g = grpo.grpo
    assert (g.noise_level, g.clip_range, g.adv_clip_max, g.kl_beta, g.timestep_fraction, g.global_std,
            g.updates_per_step) == (0.7, 1e-4, 5.0, 0.0, 0.99, True, 2)
    assert grpo.trained_steps == 9 and grpo.rank_sample_parts == 2 and nft.rank_sample_parts == 1


def test_sd35m_pickscore_grpo_holds_flow_grpo_s_pickscore_sd3_values():
    c = load_config("sd35m_pickscore_grpo")
    r, g, t, o = c.rollout, c.grpo, c.train, c.optim
    assert c.algo.name == "flow_grpo" and c.samples_per_step == 48 * 24
    assert (r.num_steps, r.guidance_scale, r.height, r.max_sequence_length, r.solver) == (10, 4.5, 512, 128, "euler")
    assert (g.noise_level, g.clip_range, g.adv_clip_max, g.kl_beta, g.timestep_fraction, g.global_std,
            g.updates_per_step) == (0.7, 1e-4, 5.0, 0.01, 0.99, True, 2)
    assert (t.finetune, t.lora_rank, t.lora_alpha, t.precision) == ("lora", 32, 64, "fp16")
    assert (o.lr, o.weight_decay, o.beta1, o.beta2, o.eps, o.grad_clip) == (3e-4, 1e-4, 0.9, 0.999, 1e-8, 1.0)
    assert (c.eval.policy, c.eval.ema_decay, c.eval.ema_update_every, c.eval.num_steps, c.eval.every,
            c.eval.at_start) == ("ema", 0.9, 8, 40, 60, True)
    check_layout(c, 3)  # 576 samples a train rank, 288 an update


def _other_value(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, str):
        return {"first": "random_per_sample", "position": "prompt", "all": "binary", "unbiased": "population"}[value]
    return value * 0.5 if isinstance(value, float) and value else (value + 1 if isinstance(value, int) else 0.5)


def _fields(section):
    return [(f.name, getattr(section(), f.name)) for f in dataclasses.fields(section)]


@pytest.mark.parametrize("key, value", _fields(GRPOConfig))
def test_a_grpo_key_under_nft_is_refused(key, value):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [f"grpo.{key}={_other_value(value)!r}".replace("True", "true").replace("False", "false")])
    assert str(e.value).startswith(f"grpo.{key}: a Flow-GRPO key, but algo.name is 'nft'"), e.value


@pytest.mark.parametrize("section, cls", [("nft", NFTConfig), ("ema", EMAConfig)])
def test_nft_and_ema_keys_under_flow_grpo_are_refused(section, cls):
    for key, value in _fields(cls):
        other = _other_value(value)
        literal = f'"{other}"' if isinstance(other, str) else str(other).lower()
        with pytest.raises(ConfigError) as e:
            load_config("tiny_learns_grpo", [f"{section}.{key}={literal}"])
        assert str(e.value).startswith(f"{section}.{key}: ") and "algo.name is 'flow_grpo'" in str(e.value), e.value


def test_each_algorithm_takes_its_own_keys_and_the_other_s_at_their_defaults():
    load_config("tiny_learns_grpo", ["grpo.clip_range=0.2", "nft.beta=1.0", "ema.max=0.5"])
    load_config("tiny", ["nft.beta=0.5", "grpo.noise_level=0.7"])


@pytest.mark.parametrize("value", ["0", "0.0", "-0.5", "nan"])
def test_a_noise_level_of_zero_or_below_is_refused(value):
    with pytest.raises(ConfigError, match="^grpo.noise_level: must be"):
        load_config("tiny_learns_grpo", [f"grpo.noise_level={value}"])


@pytest.mark.parametrize("override, key", [
    ('rollout.solver="dpm2"', "rollout.solver"),
    ("rollout.integer_timesteps=true", "rollout.integer_timesteps"),
    ("perf.old_pass_batch=8", "perf.old_pass_batch"),
    ("perf.v_old_fp8=true", "perf.v_old_fp8"),
    ("perf.rollout_fp8=true", "perf.rollout_fp8"),
    ("grpo.kl_beta=0.01", "grpo.kl_beta"),  # tiny_learns trains the full DiT: there is no frozen base
    ("grpo.timestep_fraction=0.05", "grpo.timestep_fraction"),
    ("grpo.updates_per_step=3", "grpo.updates_per_step"),
])
def test_what_flow_grpo_cannot_take_is_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        load_config("tiny_learns_grpo", [override])
    assert str(e.value).startswith(f"{key}: "), e.value


def test_the_kl_term_is_taken_with_lora():
    assert load_config("tiny_learns_grpo", ['train.finetune="lora"', "grpo.kl_beta=0.01"]).grpo.kl_beta == 0.01


def test_updates_must_split_each_train_rank_s_samples():
    cfg = load_config("tiny_learns_grpo", ["grpo.updates_per_step=4"])  # 16 samples a step
    check_layout(cfg, 2)  # one train rank: 16 = 4 x 4
    with pytest.raises(ConfigError, match="^grpo.updates_per_step: the 8 samples of each of 2 train ranks do not "
                                          "split into 16 equal updates$"):
        check_layout(load_config("tiny_learns_grpo", ["grpo.updates_per_step=16"]), 3)
    check_layout(load_config("tiny_learns_grpo", ["grpo.updates_per_step=8"]), 3)
