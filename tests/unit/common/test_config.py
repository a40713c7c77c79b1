"""The config (hpcnft.algo.root_config over hpcnft.common.config): recipes, --set parsing,
refusals, and each vocabulary held by its owner alone (docs/configuration.md; nft_spec.md §5)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hpcnft.algo.root_config import ConfigError, load_config
from hpcnft.common.config import parse_set
from hpcnft.common.recipe_files import recipe_names
from hpcnft.run.config_changes import differing_keys

ATTENTION_PROJECTIONS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                         "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"]


def test_builtin_recipes_load():
    assert {"tiny", "sd35m_pickscore"} <= set(recipe_names())
    tiny = load_config("tiny")
    assert tiny.rollout.height == 64 and tiny.train.precision == "fp32"  # the CPU recipe
    load_config("sd35m_pickscore")


def test_sd35m_pickscore_matches_the_miles_column():
    c = load_config("sd35m_pickscore")
    r, n, t, o, e = c.rollout, c.nft, c.train, c.optim, c.ema
    assert (r.prompts_per_step, r.samples_per_prompt, c.samples_per_step) == (8, 8, 64)
    assert t.micro_batch == 4
    assert o.lr == 3e-4 and o.weight_decay == 1e-4 and o.grad_clip == 1.0
    assert (o.beta1, o.beta2, o.eps) == (0.9, 0.999, 1e-8)
    assert t.finetune == "lora" and t.lora_rank == 32 and t.lora_alpha == 64
    assert sorted(t.lora_targets) == sorted(ATTENTION_PROJECTIONS) and len(t.lora_targets) == 8
    assert n.beta == 1.0 and n.adv_clip_max == 5.0 and n.timestep_fraction == 0.99
    assert n.timestep_strategy == "first" and n.shuffle_timesteps is True and n.adaptive_weight is True
    assert n.std_estimator == "unbiased" and n.kl_beta == 0.0
    assert r.num_steps == 10 and r.guidance_scale == 1.0 and (r.height, r.width) == (512, 512)
    assert e.ramp == 0.001 and e.max == 0.5 and e.flat_steps == 0
    assert t.precision == "fp16" and t.grad_scaler_init == 65536.0
    assert t.grad_checkpointing is True
    assert t.seed == 1234 and r.seed == 42
    assert c.eval.every == 30 and c.eval.num_steps == 50 and c.checkpoint.every == 20
    assert c.steps == 100


# ---------------------------------------------------------------------------------------------
# --set parsing
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("item, key, value, typ", [
    ("steps=7", "steps", 7, int),
    ("optim.lr=1e-3", "optim.lr", 1e-3, float),
    ("optim.lr=0.5", "optim.lr", 0.5, float),
    ("data.shuffle=true", "data.shuffle", True, bool),
    ("data.shuffle=false", "data.shuffle", False, bool),
    ("train.finetune=full", "train.finetune", "full", str),
    ('train.finetune="full"', "train.finetune", "full", str),
    ("train.finetune='lora'", "train.finetune", "lora", str),
    ("models.sd3_dir=/a/b c", "models.sd3_dir", "/a/b c", str),
    ("x.y=a=b", "x.y", "a=b", str),
    ('train.lora_targets=["attn.to_q", "attn.to_k"]', "train.lora_targets", ["attn.to_q", "attn.to_k"], list),
    (" steps =3", "steps", 3, int),
])
def test_parse_set(item, key, value, typ):
    k, v = parse_set(item)
    assert k == key and v == value and type(v) is typ


def test_parse_set_needs_an_equals_sign():
    with pytest.raises(ConfigError, match="optim.lr"):
        parse_set("optim.lr")


def test_overrides_reach_the_config():
    c = load_config("tiny", ["optim.lr=1e-3", "train.finetune=full", "data.shuffle=true", "steps=3",
                             'train.lora_targets=["attn.to_q"]', "optim.grad_clip=2", 'models.sd3_dir="/m"'])
    assert c.optim.lr == 1e-3 and c.train.finetune == "full" and c.data.shuffle is True and c.steps == 3
    assert c.train.lora_targets == ["attn.to_q"]
    assert c.optim.grad_clip == 2.0 and isinstance(c.optim.grad_clip, float)  # int accepted for a float
    assert c.models.sd3_dir == "/m"


def test_steps_and_run_dir_arguments():
    c = load_config("tiny", steps=4, run_dir="/tmp/x")
    assert c.steps == 4 and c.run_dir == "/tmp/x"


# ---------------------------------------------------------------------------------------------
# refusals, each naming the key
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("item, names", [
    ("optim.lrr=1", ["optim.lrr"]),
    ("nope.x=1", ["nope"]),
    ("nope=1", ["nope"]),
    ("rollout.nope.deeper=1", ["rollout.nope"]),
])
def test_unknown_key_is_refused_naming_it(item, names):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [item])
    msg = str(e.value)
    assert "unknown" in msg
    for n in names:
        assert n in msg


@pytest.mark.parametrize("item, key", [
    ("optim.lr=abc", "optim.lr"),  # bare string where a number belongs
    ("optim.lr=true", "optim.lr"),
    ("steps=1.5", "steps"),
    ("steps=true", "steps"),
    ("rollout.seed=1e3", "rollout.seed"),
    ("data.shuffle=1", "data.shuffle"),
    ("data.shuffle=yes", "data.shuffle"),
    ("train.finetune=3", "train.finetune"),
    ("train.lora_targets=attn.to_q", "train.lora_targets"),
    ("train.lora_targets=[1, 2]", "train.lora_targets"),
    ("optim=3", "optim"),
])
def test_wrong_type_is_refused_naming_the_key(item, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("tiny", [item])


@pytest.mark.parametrize("items, key", [
    (["optim.lr=-3e-4"], "optim.lr"),
    (["optim.lr=0"], "optim.lr"),
    (["optim.lr=nan"], "optim.lr"),
    (["optim.weight_decay=-1e-4"], "optim.weight_decay"),
    (["nft.timestep_fraction=1.5"], "nft.timestep_fraction"),
    (["nft.timestep_fraction=0.05"], "nft.timestep_fraction"),  # int(10 * 0.05) = 0 sigmas
    (["rollout.height=500"], "rollout.height"),
    (["rollout.width=520"], "rollout.width"),
    (["rollout.batch_size=17"], "rollout.batch_size"),  # tiny: 4 x 4 = 16 samples per step
    (["rollout.prompts_per_step=2", "rollout.batch_size=9"], "rollout.batch_size"),
    (["ema.max=1.5"], "ema.max"),
    (["steps=0"], "steps"),
    (["train.precision=fp8"], "train.precision"),
    (["nft.std_estimator=biased"], "nft.std_estimator"),
    (["nft.timestep_strategy=last"], "nft.timestep_strategy"),
])
def test_out_of_range_is_refused_naming_the_key(items, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("tiny", items)


@pytest.mark.parametrize("key", ["optim.lr", "nft.beta", "nft.adv_clip_max"])
def test_infinite_values_are_refused(key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("tiny", [f"{key}=inf"])


def test_batch_size_equal_to_samples_per_step_is_fine():
    assert load_config("tiny", ["rollout.batch_size=16"]).rollout.batch_size == 16
    assert load_config("tiny", ["rollout.height=80"]).rollout.height == 80  # 5 * 16


def test_unknown_recipe_lists_the_known_ones():
    with pytest.raises(ConfigError) as e:
        load_config("no_such_recipe")
    msg = str(e.value)
    assert "no_such_recipe" in msg and "tiny" in msg and "sd35m_pickscore" in msg


def test_a_toml_file_is_a_recipe(tmp_path):
    p = tmp_path / "mine.toml"
    p.write_text('steps = 3\n[optim]\nlr = 1e-3\n[rollout]\nheight = 32\nwidth = 48\nbatch_size = 2\n')
    c = load_config(str(p), ["optim.weight_decay=0"])
    assert c.steps == 3 and c.optim.lr == 1e-3 and (c.rollout.height, c.rollout.width) == (32, 48)
    assert c.optim.weight_decay == 0.0
    assert c.optim.grad_clip == 1.0  # defaults fill the rest


def test_a_toml_file_with_bad_content_is_refused(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[optim\nlr = ")
    with pytest.raises(ConfigError, match="bad.toml"):
        load_config(str(bad))
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[optim]\nlrr = 1e-3\n")
    with pytest.raises(ConfigError, match=r"optim\.lrr"):
        load_config(str(unknown))
    with pytest.raises(ConfigError, match="missing.toml"):
        load_config(str(tmp_path / "missing.toml"))


def test_differing_keys_ignores_run_length_but_reports_the_rest():
    a = load_config("tiny").to_dict()
    assert differing_keys(a, load_config("tiny", ["steps=99"]).to_dict()) == []
    assert differing_keys(a, load_config("tiny", ["steps=99", "optim.lr=1e-3"]).to_dict()) == ["optim.lr"]
    assert differing_keys(a, load_config("tiny", ["checkpoint.every=1", "nft.beta=0.5"]).to_dict()) == ["nft.beta"]


# ---------------------------------------------------------------------------------------------
# values and paths: typed, bounded, never interpreted by a shell
# ---------------------------------------------------------------------------------------------
NASTY = "x; touch MARKER 'q' \"dq\" $(touch M2) `touch M3` | cat"


def test_nasty_strings_are_plain_values(tmp_path):
    cfg = load_config("tiny", [f"data.train_prompts={tmp_path}/{NASTY}/p.txt"], run_dir=str(tmp_path / NASTY))
    assert cfg.data.train_prompts == f"{tmp_path}/{NASTY}/p.txt"
    assert cfg.run_dir == str(tmp_path / NASTY)


def test_a_nasty_prompt_path_is_refused_in_one_line_and_runs_nothing(tmp_path, monkeypatch, capsys):
    from hpcnft import cli

    monkeypatch.chdir(tmp_path)
    umask = os.umask(0o022)
    try:
        rc = cli.main(["run", "tiny", "--run-dir", NASTY, "--set", f"data.train_prompts=/nonexistent/{NASTY}"])
    finally:
        os.umask(umask)  # `hpcnft run` sets the configured umask for its process
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "data.train_prompts" in err
    assert os.listdir(tmp_path) == []  # no run dir, no MARKER, M2 or M3


@pytest.mark.parametrize("item,message", [
    ("umask=\"999\"", "umask: expected an octal mask"),
    ("umask=77", "umask: expected a string"),
    ("layout.timeout_s=inf", "layout.timeout_s: must be a finite number"),
    ("layout.timeout_s=1e9", "layout.timeout_s: must be <= 86400"),
    ("rollout.height=16384", "rollout.height: must be <= 8192"),
    ("rollout.batch_size=99999", "rollout.batch_size: must be <= 4096"),
    ("ema.max=-0.5", "ema.max: must be >= 0"),
    ("ema.max=1.5", "ema.max: must be within .0, 1., got 1.5"),
    ("run_dir=\"a\\u0000b\"", "run_dir: must not contain NUL"),
    ("data.eval_prompts=\"a\\nb\"", "data.eval_prompts: must not contain NUL or newline"),
    ("steps=\"3; rm -rf /\"", "steps: expected an integer"),
])
def test_config_values_are_typed_and_bounded(item, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config("tiny", [item])


def test_a_chunk_the_reward_service_would_refuse_is_a_config_error():
    with pytest.raises(ConfigError, match="rollout.batch_size: a chunk of"):
        load_config("sd35m_pickscore", ["rollout.height=8192", "rollout.width=8192", "rollout.batch_size=8"])


def test_umask_is_a_config_value():
    assert load_config("tiny").umask == "077"
    assert load_config("tiny", ["umask=027"]).umask == "027"  # a bare word: the string "027"


def test_trackers_default_to_none_and_take_the_known_names():
    assert load_config("tiny").logging.trackers == []
    cfg = load_config("tiny", ['logging.trackers=["tensorboard", "wandb"]'])
    assert cfg.logging.trackers == ["tensorboard", "wandb"]


@pytest.mark.parametrize("value, names", [
    ('["mlflow"]', ["logging.trackers", "'mlflow'", "tensorboard, wandb"]),
    ('["wandb", "wandb"]', ["logging.trackers", "'wandb'", "more than once"]),
    ("tensorboard", ["logging.trackers", "expected a list"]),
])
def test_bad_trackers_are_refused_naming_the_key(value, names):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [f"logging.trackers={value}"])
    for name in names:
        assert name in str(e.value)


def test_trackers_may_change_on_resume():
    a = load_config("tiny").to_dict()
    b = load_config("tiny", ['logging.trackers=["tensorboard"]']).to_dict()
    assert differing_keys(a, b) == []


def test_the_layout_is_checked_against_the_world_size():
    from hpcnft.distributed.config import check_layout, local_world_size

    cfg = load_config("tiny")  # 16 samples a step
    assert local_world_size(cfg) == 3
    check_layout(cfg, 3)
    check_layout(cfg, 1)  # one process: colocated
    with pytest.raises(ConfigError, match="16 samples per step do not split evenly over 3 train ranks"):
        check_layout(load_config("tiny", ["layout.train_ranks=3"]), 4)
    with pytest.raises(ConfigError, match="layout.reward_ranks: 2 leaves no train rank in a world of 2"):
        check_layout(load_config("tiny", ["layout.reward_ranks=2"]), 2)
    assert local_world_size(load_config("tiny", ["layout.train_ranks=1", "layout.reward_ranks=0"])) == 1


# ---------------------------------------------------------------------------------------------
# one source per vocabulary: each section's choices are its owner's, and the config imports no torch
# ---------------------------------------------------------------------------------------------
def test_the_choices_are_what_their_owners_implement():
    from hpcnft.algo import config as algo_config
    from hpcnft.algo import policy, solvers
    from hpcnft.algo.nft import config as nft_config, formulas as nft
    from hpcnft.distributed import reward_limits, reward_service
    from hpcnft.io import config as io_config
    from hpcnft.io import trackers
    from hpcnft.models import config as models_config
    from hpcnft.models import families
    from hpcnft.perf import config as perf_config
    from hpcnft.perf import levers, towers
    from hpcnft.rewards import config as rewards_config
    from hpcnft.rewards import http_protocol, registry

    # the same objects: defined once, imported where they are used
    assert nft.ADV_MODES is nft_config.ADV_MODES and registry.MODULES is rewards_config.MODULES
    assert levers.FAST is perf_config.FAST and levers.ATTENTION_BACKENDS is perf_config.ATTENTION_BACKENDS
    for name in ("MAX_CHUNK", "MAX_SIDE", "MAX_CHUNK_BYTES"):
        assert getattr(reward_service, name) == getattr(http_protocol, name) == getattr(reward_limits, name)
    assert rewards_config.TERM_KINDS == tuple(registry.MODULES)
    # names whose implementations need torch: the owner's table of them has exactly the config's names
    assert tuple(solvers.SOLVERS) == algo_config.SOLVERS
    assert tuple(families.FAMILIES) == models_config.FAMILIES
    assert ("auto", *towers.VAE_DTYPES) == perf_config.VAE_DECODE_DTYPES
    assert ("fp32", *policy.AUTOCAST_DTYPES) == algo_config.PRECISIONS
    assert {t.name for t in (trackers.TensorBoardTracker, trackers.WandbTracker)} == set(io_config.TRACKERS)


def test_the_refusals_name_the_owners_vocabulary():
    with pytest.raises(ConfigError, match="nft.adv_mode: 'best' is not one of all, positive_only, negative_only, "
                                          "one_only, binary"):
        load_config("tiny", ["nft.adv_mode=best"])
    with pytest.raises(ConfigError, match="rollout.solver: 'heun' is not one of euler, dpm2"):
        load_config("tiny", ["rollout.solver=heun"])
    with pytest.raises(ConfigError, match=r"reward.terms\[0\].kind: 'geneval' is not one of pickscore, hpsv2, "
                                          "clipscore, aesthetic, jpeg_compressibility, jpeg_incompressibility, ocr, "
                                          "remote"):
        load_config("tiny", ['reward.terms=[{kind = "geneval"}]'])
    with pytest.raises(ConfigError, match="rollout.width: must be <= 8192, got 8208"):
        load_config("tiny", ["rollout.width=8208"])


def test_loading_a_config_imports_no_torch():
    code = ("import sys; from hpcnft.algo.root_config import load_config; "
            "load_config('sd35m_pickscore_fast', ['logging.trackers=[\"wandb\"]']); print('torch' in sys.modules)")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert out.stdout.strip() == "False"


def test_what_a_resume_may_change_is_declared_beside_each_key():
    """on_resume in setting(): the keys a resume may change, silently or with a warning, are the
    ones declared so; every other key is refused; a bad declaration fails at once."""
    from dataclasses import dataclass

    from hpcnft.algo.root_config import Config
    from hpcnft.common.config import documented_keys, keys_on_resume, setting
    from hpcnft.run.config_changes import RESUME_MUTABLE_KEYS, RESUME_WARNED_KEYS

    assert RESUME_MUTABLE_KEYS == keys_on_resume(Config, "free") and RESUME_WARNED_KEYS == keys_on_resume(Config, "warn")
    assert {"steps", "checkpoint.every", "layout.timeout_s", "perf.overlap_reward"} <= RESUME_MUTABLE_KEYS
    assert {"reward.terms[].url", "reward.terms[].token_env"} <= RESUME_WARNED_KEYS
    every = {key for key, _, _ in documented_keys(Config)}
    assert keys_on_resume(Config, "fixed") == every - RESUME_MUTABLE_KEYS - RESUME_WARNED_KEYS
    assert "nft.beta" in keys_on_resume(Config, "fixed") and "rollout.seed" in keys_on_resume(Config, "fixed")

    @dataclass
    class Probe:
        a: int = setting(1, "a", on_resume="free")
        b: int = setting(2, "b")
    assert keys_on_resume(Probe, "free") == {"a"} and keys_on_resume(Probe, "fixed") == {"b"}
    with pytest.raises(ValueError, match="on_resume 'sometimes'"):
        setting(3, "c", on_resume="sometimes")
