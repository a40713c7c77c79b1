"""Which config changes a resume allows: reward.terms compared per term and per key, a remote
term's url, timeout_s, retry_for_s, retries and token_env allowed (warned about),
perf.overlap_reward allowed, what is scored refused, and the description of the changes one
line of bounded length."""
from __future__ import annotations

import pytest
from config_terms import JUDGE, judge, with_terms

from hpcnft.algo.root_config import load_config
from hpcnft.run.config_changes import (
    CHANGES_LISTED,
    config_changes,
    describe_changes,
    differing_keys,
    warned_on_resume,
)


def terms(*tables: str) -> dict:
    return with_terms(*tables).to_dict()


BEFORE = terms('kind="pickscore"', JUDGE)


@pytest.mark.parametrize("setting", ['url="http://judge:9000/v1/score/ocr"', "timeout_s=80", "retries=7",
                                     "retry_for_s=5", 'token_env="HPCNFT_OCR_TOKEN"', 'token_env=""'])
def test_where_and_how_patiently_a_remote_term_asks_may_change(setting):
    after = terms('kind="pickscore"', judge(setting))
    key = f"reward.terms[1].{setting.split('=')[0]}"
    assert differing_keys(BEFORE, after) == []
    assert [c.key for c in config_changes(BEFORE, after)] == [key] and warned_on_resume(key)


@pytest.mark.parametrize("setting,change", [
    ("weight=2.0", "reward.terms[1].weight (1.0 -> 2.0)"),
    ('name="judge"', "reward.terms[1].name ('ocr' -> 'judge')"),
    ("eval_only=true", "reward.terms[1].eval_only (False -> True)"),
    ('model_dir="/m"', "reward.terms[1].model_dir ('' -> '/m')"),
])
def test_what_a_term_scores_may_not_change_and_the_key_is_named(setting, change):
    after = terms('kind="pickscore"', judge(setting))
    key = change.split(" ")[0]
    assert differing_keys(BEFORE, after) == [key]
    assert describe_changes(config_changes(BEFORE, after)) == change


def test_a_changed_kind_or_order_names_each_key():
    after = terms(JUDGE, 'kind="pickscore"')  # the same two terms, swapped
    keys = differing_keys(BEFORE, after)
    assert "reward.terms[0].kind" in keys and "reward.terms[1].kind" in keys
    assert all(k.startswith("reward.terms[") for k in keys)
    kind = terms('kind="hpsv2"', JUDGE)
    assert differing_keys(BEFORE, kind) == ["reward.terms[0].kind"]
    assert describe_changes(config_changes(BEFORE, kind)) == "reward.terms[0].kind ('pickscore' -> 'hpsv2')"


def test_another_number_of_terms_is_one_change():
    for after, text in [(terms('kind="pickscore"'), "reward.terms (2 entries -> 1 entry)"),
                        (load_config("tiny").to_dict(), "reward.terms (2 entries -> 0 entries)")]:
        assert differing_keys(BEFORE, after) == ["reward.terms"]
        assert describe_changes(config_changes(BEFORE, after)) == text


def test_a_refused_change_beside_an_allowed_one_is_still_refused():
    after = terms('kind="pickscore", weight=0.5', judge('url="http://elsewhere:1/x"'))
    assert differing_keys(BEFORE, after) == ["reward.terms[0].weight"]


def test_terms_are_listed_in_index_order():
    many = [f'kind="jpeg_compressibility", name="t{i}"' for i in range(12)]
    after = [t + ", weight=3.0" for t in many]
    keys = differing_keys(terms(*many), terms(*after))
    assert keys == [f"reward.terms[{i}].weight" for i in range(12)]


def test_the_description_is_one_line_of_bounded_length():
    long = "x" * 5000
    after = terms(f'kind="pickscore", model_dir="{long}\\nline two"', f'{JUDGE}, processor_dir="{long}"')
    after["optim"] = {k: v * 3 for k, v in after["optim"].items()}
    changes = config_changes(BEFORE, after)
    assert len(changes) > CHANGES_LISTED
    text = describe_changes(changes)
    assert "\n" not in text and len(text) < 700
    assert text.endswith(f" and {len(changes) - CHANGES_LISTED} more")
    assert text.startswith("optim.beta1 (0.9 -> 2.7")


def test_run_length_and_other_mutable_keys_stay_silent():
    after = load_config("tiny", ["steps=99", "checkpoint.every=1"]).to_dict()
    assert config_changes(load_config("tiny").to_dict(), after) == []


def test_a_config_from_before_a_key_existed_reads_it_as_its_default():
    """A checkpoint of a run made before `algo` and `[grpo]` existed resumes as DiffusionNFT; a
    start that asks for Flow-GRPO is refused, naming the key."""
    now = load_config("tiny").to_dict()
    before = {k: v for k, v in now.items() if k not in ("algo", "grpo")}
    assert differing_keys(before, now) == []
    assert differing_keys(before, load_config("tiny", ["algo.name=flow_grpo"]).to_dict()) == ["algo.name"]
    assert differing_keys(now, before) == ["algo.name"] + [f"grpo.{k}" for k in sorted(now["grpo"])]


def test_overlapping_the_reward_with_sampling_may_change_on_resume():
    # perf.overlap_reward scores in a worker thread with the synchronous path's kernels, in the
    # same order: the scores are the same, so a resume may turn it on or off (it was refused)
    before = load_config("tiny", ["layout.train_ranks=1", "layout.reward_ranks=0"]).to_dict()
    after = load_config("tiny", ["layout.train_ranks=1", "layout.reward_ranks=0", "perf.overlap_reward=true"])
    assert differing_keys(before, after.to_dict()) == [] and config_changes(before, after.to_dict()) == []
