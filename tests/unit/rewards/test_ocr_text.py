"""The OCR reward's formula (hpcnft.rewards.ocr_text) against a transcription of the official
DiffusionNFT scorer's (flow_grpo/ocr.py) on strings, and the checks around the `ocr` term that
need no recognizer: prompts without quoted text refused in one line, the extra it needs, its
bundled models."""
from __future__ import annotations

import pytest

from hpcnft.algo.root_config import ConfigError, load_config
from hpcnft.rewards import ocr_text

Levenshtein = pytest.importorskip("Levenshtein")


def official_reward(recognized_lines, prompt: str) -> float:
    """flow_grpo/ocr.py's OcrScorer.__call__ for one image, the recognizer's result given as its
    (text, confidence) lines (None: nothing detected)."""
    prompt = prompt.split('"')[1]
    recognized_text = "".join([text if conf > 0 else "" for text, conf in recognized_lines]) \
        if recognized_lines else ""
    recognized_text = recognized_text.replace(" ", "").lower()
    prompt = prompt.replace(" ", "").lower()
    if prompt in recognized_text:
        dist = 0
    else:
        dist = Levenshtein.distance(recognized_text, prompt)
    if dist > len(prompt):
        dist = len(prompt)
    return 1 - dist / len(prompt)


CASES = [
    ([("OPEN LATE", 0.99)], 'a sign that says "OPEN LATE"'),           # exact, spaces dropped
    ([("open", 0.9), ("late", 0.8)], 'a sign that says "OPEN LATE"'),  # lines joined, case folded
    ([("Welcome to the OPEN LATE diner", 0.7)], 'a sign "open late"'),  # contained in a longer text: 0
    ([("OPEN LAIE", 0.9)], 'a sign that says "OPEN LATE"'),           # one substitution
    ([("OPN", 0.9)], 'a sign that says "OPEN LATE"'),                  # deletions
    ([("xxxxxxxxxxxxxxxxxxxxxxxx", 0.9)], 'says "CAT"'),               # far longer: the cap, 0
    ([("CAR", 0.9)], 'says "CAT"'),                                    # 1 - 1/3
    ([("CAT", 0.0)], 'says "CAT"'),                                    # confidence 0 is dropped
    ([("C", 0.6), ("", 0.5), ("T", 0.4)], 'says "CAT"'),
    ([], 'says "CAT"'),                                                # nothing read: 0
    (None, 'a sign "OPEN" and "LATE"'),                               # the first span only
    ([("LATE", 0.9)], 'a sign "OPEN" and "LATE"'),
    ([("Straße", 0.9)], 'says "STRASSE"'),                             # lower() as Python's
    ([("a\tb", 0.9)], 'says "a b"'),                                   # only spaces are removed
]


@pytest.mark.parametrize("lines, prompt", CASES)
def test_the_reward_is_the_official_formula(lines, prompt):
    text = ocr_text.recognized_text(lines or [])
    assert ocr_text.reward(text, ocr_text.target(prompt)) == official_reward(lines, prompt)


def test_the_distance_is_capped_at_the_target_and_zero_when_contained():
    assert ocr_text.distance("", "open") == 4
    assert ocr_text.distance("completely different words", "open") == 4
    assert ocr_text.distance("xx open xx", "open") == 0
    assert ocr_text.distance("opne", "open") == 2
    assert ocr_text.reward("", "open") == 0.0


@pytest.mark.parametrize("prompt, why", [("a sign", "no double-quoted text"), ('a lone " quote', "no double-quoted"),
                                         ('an empty "" span', "an empty double-quoted text"),
                                         ('spaces "   " only', "an empty double-quoted text")])
def test_a_prompt_without_quoted_text_has_no_target(prompt, why):
    with pytest.raises(ValueError, match=why):
        ocr_text.target(prompt)


def test_a_prompt_file_with_an_unquoted_prompt_is_refused_in_one_line():
    cfg = load_config("tiny_ocr")
    good = ['a "SIGN"', 'says "OPEN"']
    cfg.reward.check_prompts(good, good)
    with pytest.raises(ConfigError) as e:
        cfg.reward.check_prompts(good + ["a photo of a cat"], good)
    text = str(e.value)
    assert text.startswith("data.train_prompts: prompt 3 of 3 has no double-quoted text for the OCR term 'ocr'")
    assert "'a photo of a cat'" in text and len(text.splitlines()) == 1
    with pytest.raises(ConfigError, match="^data.eval_prompts: prompt 1 of 1 has an empty"):
        cfg.reward.check_prompts(good, ['an empty ""'])


def test_an_eval_only_ocr_term_checks_the_eval_prompts_alone():
    cfg = load_config("tiny", ['reward.terms=[{kind="pickscore"}, {kind="ocr", eval_only=true}]'])
    cfg.reward.check_prompts(["no quotes at all"], ['a "SIGN"'])  # training prompts go to PickScore only
    with pytest.raises(ConfigError, match="data.eval_prompts"):
        cfg.reward.check_prompts(['a "SIGN"'], ["no quotes"])
    load_config("tiny").reward.check_prompts(["no quotes"], ["none"])  # no ocr term: nothing to check


@pytest.mark.parametrize("field", ["model_dir", "processor_dir", "weights"])
def test_the_ocr_terms_models_come_with_its_extra(field):
    with pytest.raises(ConfigError, match=rf"reward.terms\[0\].{field}: the ocr term's models come with its extra"):
        load_config("tiny", [f'reward.terms=[{{kind="ocr", {field}="/m"}}]'])


def test_a_missing_extra_is_named_with_the_command_that_installs_it(monkeypatch):
    import importlib.util

    cfg = load_config("tiny_ocr")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: None if name == "rapidocr_onnxruntime" else real(name))
    assert cfg.reward.missing_extra() == ("reward term 'ocr' (kind 'ocr') needs the 'ocr' extra, and "
                                          "rapidocr_onnxruntime is not installed here: pip install 'hpcnft[ocr]'")
    assert load_config("tiny").reward.missing_extra() is None


def test_a_config_without_a_pickscore_term_builds_no_tiny_pickscore():
    from hpcnft.models.tiny_cache import tiny_models_used

    assert tiny_models_used(load_config("sd35m_ocr")) == (False, False)  # the real SD3.5, OCR alone
    assert tiny_models_used(load_config("sd35m_pickscore", ["models.pickscore_dir=''"]))[0]
    assert tiny_models_used(load_config("tiny_ocr"))[0]  # the tiny SD3.5 (built with the tiny PickScore)
