"""The config check of a resume: a remote term's url, timeout_s, retries and token_env may
change with a warning on the resume plan (the warnings the job reports); what is scored is
refused in one bounded line naming the key."""
from __future__ import annotations

import json
import os

import pytest
from config_terms import JUDGE, judge, with_terms
from hardening_tools import run_with_checkpoints

from hpcnft.algo.root_config import ConfigError
from hpcnft.io import run_state
from hpcnft.run import resume

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]  # DCP in one process


def checkpoint_dir(tmp_path, cfg) -> str:
    path = tmp_path / "step_000002"
    path.mkdir()
    (path / "config.json").write_text(cfg.to_json())
    return str(path)


@pytest.mark.parametrize("setting", ['url="http://judge:9000/v1/score/ocr"', "timeout_s=80", "retries=7",
                                     "retry_for_s=5", 'token_env="HPCNFT_OCR_TOKEN"', 'token_env=""'])
def test_a_remote_terms_endpoint_and_patience_may_change_with_a_warning(tmp_path, setting):
    path = checkpoint_dir(tmp_path, with_terms('kind="pickscore"', JUDGE))
    key = setting.split("=")[0]
    warning = resume._check_config(with_terms('kind="pickscore"', judge(setting)), "runs/a", path)
    assert warning.startswith(f"resuming with settings changed since checkpoint {path}: reward.terms[1].{key} (")
    assert "\n" not in warning
    assert resume._check_config(with_terms('kind="pickscore"', JUDGE), "runs/a", path) == ""


@pytest.mark.parametrize("first,second,change", [
    ('kind="pickscore", weight=2.0', JUDGE, "reward.terms[0].weight (1.0 -> 2.0)"),
    ('kind="hpsv2"', JUDGE, "reward.terms[0].kind ('pickscore' -> 'hpsv2')"),
    ('kind="pickscore"', judge('url="http://judge:9000/x"') + ", weight=0.5", "reward.terms[1].weight (1.0 -> 0.5)"),
])
def test_what_is_scored_may_not_change_and_the_refusal_names_the_key(tmp_path, first, second, change):
    path = checkpoint_dir(tmp_path, with_terms('kind="pickscore"', JUDGE))
    with pytest.raises(ConfigError) as e:
        resume._check_config(with_terms(first, second), "runs/a", path)
    assert str(e.value) == f"cannot resume runs/a: the config differs from its checkpoint in {change}"


def test_a_refusal_of_many_changes_is_one_bounded_line(tmp_path):
    path = checkpoint_dir(tmp_path, with_terms('kind="pickscore"', JUDGE))
    long = "y" * 3000
    other = with_terms(f'kind="pickscore", model_dir="{long}", processor_dir="{long}", weights="{long}"',
                       f'{JUDGE}, weight=3.0, eval_only=true, model_dir="{long}"')
    with pytest.raises(ConfigError) as e:
        resume._check_config(other, "runs/a", path)
    text = str(e.value)
    assert "\n" not in text and len(text) < 800 and text.endswith(" and 1 more")


@pytest.fixture
def run(tmp_path):
    """A run dir whose checkpoints 1 and 2 hold a config with a remote term, and its run.h5."""
    cfg = with_terms('kind="pickscore"', JUDGE)
    cfg.run_dir = str(tmp_path / "run")
    return cfg, run_with_checkpoints(cfg)


def moved(cfg, port: int = 9000):
    other = with_terms('kind="pickscore"', f'{JUDGE.replace("8000", str(port))}')
    other.run_dir = cfg.run_dir
    return other


def test_the_resume_plan_carries_the_warning_the_job_reports(run):
    cfg, ckpts = run
    plan = resume.agree_plan(moved(cfg), 0)
    assert plan.checkpoint == (2, ckpts[2])
    assert plan.warnings == [(
        f"resuming with settings changed since checkpoint {ckpts[2]}: reward.terms[1].url "
        f"('http://judge:8000/v1/score/ocr' -> 'http://judge:9000/v1/score/ocr') (a remote term's endpoint "
        f"must score as the old one did for the run to stay comparable)")]
    assert resume.agree_plan(cfg, 0).warnings == []


def test_a_rebuild_from_an_older_checkpoint_warns_about_that_checkpoints_settings(run):
    cfg, ckpts = run
    newer = moved(cfg, 9000)
    with open(os.path.join(ckpts[2], "config.json"), "w") as f:  # the run resumed once at port 9000
        f.write(newer.to_json())
    os.remove(os.path.join(cfg.run_dir, "run.h5"))
    os.remove(run_state.run_state_path(ckpts[2]))  # so run.h5 is rebuilt from checkpoint 1
    warnings = []
    plan = resume.plan_resume(newer, cfg.run_dir, warnings.append)
    assert plan.checkpoint == (1, ckpts[1]) and plan.rebuild_why == "is missing"
    assert len(warnings) == 2 and warnings[0].startswith(f"skipping checkpoint {ckpts[2]} for rebuilding run.h5")
    assert warnings[1].startswith(f"resuming with settings changed since checkpoint {ckpts[1]}: reward.terms[1].url")
    with open(os.path.join(ckpts[1], "config.json")) as f:
        assert json.load(f)["reward"]["terms"][1]["url"].endswith(":8000/v1/score/ocr")


def test_check_resumable_warns_too(run):
    cfg, ckpts = run
    warnings = []
    assert resume.check_resumable(moved(cfg), cfg.run_dir, warnings.append) == (2, ckpts[2])
    assert len(warnings) == 1 and "reward.terms[1].url" in warnings[0]
