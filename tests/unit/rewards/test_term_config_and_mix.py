"""reward.terms: how a config names its terms, which terms score which requests, the training
reward made of them (the official code's weighted sum), DDPO's JPEG terms against their formula,
and the run file's keys of configured terms."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from hpcnft.algo.reward import make_score_fn, reply_columns, term_columns, training_reward
from hpcnft.algo.root_config import ConfigError, config_from_dict, load_config
from hpcnft.distributed.reward_service import EVAL, ROLLOUT
from hpcnft.io.runfile import ALL_KEYS, reward_term_keys
from hpcnft.rewards.config import RewardTermConfig
from hpcnft.rewards.registry import job_terms, load_term

TERMS = ('reward.terms=[{kind="jpeg_compressibility", weight=2.0}, {kind="jpeg_incompressibility", name="size", '
         'weight=0.5}, {kind="jpeg_incompressibility", name="size_eval", eval_only=true}]')


def _images(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(n, 3, 4, 4, generator=g) * 255  # smooth and noisy images compress differently
    smooth = torch.nn.functional.interpolate(low, size=(32, 32), mode="bilinear", align_corners=False)
    noisy = smooth + torch.rand(n, 3, 32, 32, generator=g) * 255 * torch.linspace(0, 1, n).view(n, 1, 1, 1)
    return noisy.clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def _ddpo_jpeg_kb(image: np.ndarray) -> float:
    """DDPO's jpeg_incompressibility (ddpo_pytorch/rewards.py): PIL JPEG at quality 95, kB."""
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=95)
    return buffer.tell() / 1000


def test_terms_come_from_a_recipe_table_and_from_set(tmp_path):
    recipe = tmp_path / "mix.toml"
    recipe.write_text('base = "tiny"\n[[reward.terms]]\nkind = "pickscore"\n[[reward.terms]]\n'
                      'kind = "jpeg_compressibility"\nweight = 0.25\n')
    cfg = load_config(str(recipe))
    assert [(t.kind, t.name, t.weight) for t in job_terms(cfg)] == [
        ("pickscore", "pickscore", 1.0), ("jpeg_compressibility", "jpeg_compressibility", 0.25)]
    cfg = load_config("tiny", [TERMS])
    assert [t.name for t in term_columns(cfg)["rollout"]] == ["jpeg_compressibility", "size"]
    assert [t.name for t in term_columns(cfg)["eval"]] == ["jpeg_compressibility", "size", "size_eval"]
    assert reply_columns(cfg) == {ROLLOUT: 2, EVAL: 3}
    again = config_from_dict(cfg.to_dict())  # the run file's config JSON reads back the same
    assert again.reward.terms == cfg.reward.terms


def test_no_terms_is_pickscore_alone():
    cfg = load_config("tiny")
    assert cfg.reward.terms == [] and job_terms(cfg) == [RewardTermConfig(kind="pickscore", name="pickscore")]
    assert reply_columns(cfg) == {ROLLOUT: 1, EVAL: 1}


@pytest.mark.parametrize("terms,needle", [
    ('[{kind="geneval"}]', "reward.terms[0].kind: 'geneval' is not one of"),
    ('[{kind="pickscore"}, {kind="pickscore"}]', "reward.terms[1].name: 'pickscore' names two terms"),
    ('[{kind="pickscore", name="Pick Score"}]', "reward.terms[0].name: 'Pick Score' must be lower-case"),
    ('[{kind="pickscore", eval_only=true}]', "every term is eval_only"),
    ('[{kind="remote"}]', "reward.terms[0].url: a remote term needs an http"),
    ('[{kind="pickscore", weight=nan}]', "reward.terms[0].weight: must be a finite number"),
    ('[{kind="remote", url="http://h/x", retries=-2}]', "reward.terms[0].retries: must be >= 0, or -1"),
    ('[{kind="pickscore", wieght=1.0}]', "unknown config key 'reward.terms.wieght' (did you mean 'weight'?)"),
    ('["pickscore"]', "reward.terms: expected a table of settings"),
])
def test_bad_terms_are_refused_naming_the_key(terms, needle):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [f"reward.terms={terms}"])
    assert needle in str(e.value)


def test_training_reward_is_the_official_weighted_sum():
    """flow_grpo/rewards.py multi_score: avg = sum of weight * score, no per-term normalisation."""
    cfg = load_config("tiny", [TERMS, "reward.scale=-1.5"])
    scores = torch.randn(6, 2, generator=torch.Generator().manual_seed(1))
    want = [-1.5 * (2.0 * float(a) + 0.5 * float(b)) for a, b in scores.tolist()]
    assert training_reward(scores, cfg).tolist() == pytest.approx(want, rel=1e-6)


def test_one_unit_weight_term_keeps_the_scaled_score_bit_for_bit():
    """The default (PickScore alone) trains on scale * PickScore exactly as before the terms."""
    cfg = load_config("tiny", ["reward.scale=-1"])
    s = torch.randn(64, generator=torch.Generator().manual_seed(2))
    assert torch.equal(training_reward(s[:, None], cfg), cfg.reward.scale * s)


@pytest.mark.parametrize("kind,sign", [("jpeg_incompressibility", 1.0), ("jpeg_compressibility", -1.0)])
def test_jpeg_terms_are_ddpo_formula(kind, sign):
    cfg = load_config("tiny")
    term = load_term(RewardTermConfig(kind=kind, name=kind), cfg, torch.device("cpu"))
    images = _images(5)
    got = term(["unused"] * 5, images)
    want = [sign * _ddpo_jpeg_kb(im) for im in images.numpy()]
    assert got.dtype == torch.float32 and got.tolist() == pytest.approx(want, rel=1e-6)
    assert len(set(got.tolist())) == 5  # the images differ in size
    assert torch.equal(term(["x"] * 2, images[3:5].numpy()), got[3:5])  # numpy in, batch-independent


def test_score_fn_scores_rollouts_with_training_terms_and_evaluations_with_all():
    cfg = load_config("tiny", [TERMS])
    terms = {t.name: load_term(t, cfg, torch.device("cpu")) for t in job_terms(cfg)}
    score = make_score_fn(cfg, terms)
    images = _images(4)
    kb = torch.tensor([_ddpo_jpeg_kb(im) for im in images.numpy()], dtype=torch.float32)
    rollout = score(ROLLOUT, 1, images, [0, 1, 2, 3])
    assert rollout.shape == (4, 2) and torch.equal(rollout, torch.stack([-kb, kb], dim=1))
    evaluation = score(EVAL, 0, images, [0, 1, 2, 3])
    assert evaluation.shape == (4, 3) and torch.equal(evaluation[:, 2], kb)


def test_run_file_keys_of_configured_terms():
    keys = reward_term_keys(["pickscore", "jpeg"], ["pickscore", "jpeg", "hpsv2"])
    assert keys == ["rollout/reward/pickscore/mean", "rollout/reward/pickscore/std", "rollout/reward/jpeg/mean",
                    "rollout/reward/jpeg/std", "eval/jpeg_mean", "eval/jpeg_std", "eval/hpsv2_mean", "eval/hpsv2_std"]
    assert "eval/pickscore_mean" in ALL_KEYS  # today's key, not repeated
