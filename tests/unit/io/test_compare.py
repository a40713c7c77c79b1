"""Comparison semantics of hpcnft.io.compare (docs/run_file.md#inspecting-and-comparing-runs)."""
import json
import math

import numpy as np
import pytest

from hpcnft.io.compare import (CompareError, compare_metrics, compare_series, dumps_standard, metrics_from_standard,
                            select_keys, standard_document, ulp_distance, values_match)

NEXT_AFTER_ONE = float(np.nextafter(1.0, 2.0))
HUGE_TOLERANCES = [(0.0, 0.0), (1e9, 0.0), (0.0, 1e300), (1e9, 1e300)]


def series(*values, steps=None):
    steps = range(1, len(values) + 1) if steps is None else steps
    return np.array([[s, v] for s, v in zip(steps, values)], dtype=np.float64).reshape(-1, 2)


def test_nan_matches_nan():
    assert compare_series("k", series(1.0, math.nan), series(1.0, math.nan)) is None


@pytest.mark.parametrize("rtol, atol", HUGE_TOLERANCES)
def test_nan_never_matches_a_number_in_either_direction(rtol, atol):
    for a, b in ((math.nan, 1.0), (1.0, math.nan), (math.nan, math.inf), (-math.inf, math.nan)):
        assert not values_match(a, b, rtol, atol), (a, b)
        d = compare_series("k", series(a), series(b), rtol, atol)
        assert d is not None and d.step == 1 and d.ulps is None


def test_infinities_match_only_themselves():
    assert values_match(math.inf, math.inf)
    assert values_match(-math.inf, -math.inf)
    assert not values_match(math.inf, -math.inf)
    assert not values_match(-math.inf, math.inf)


@pytest.mark.parametrize("rtol, atol", HUGE_TOLERANCES)
def test_infinity_never_matches_a_finite_value_even_under_tolerance(rtol, atol):
    assert not values_match(math.inf, 1.7e308, rtol, atol)
    assert not values_match(1.7e308, math.inf, rtol, atol)
    assert not values_match(-math.inf, -1.0, rtol, atol)
    assert not values_match(math.inf, -math.inf, rtol, atol)


def test_one_ulp_differs_exactly_and_is_reported_as_one_ulp():
    d = compare_series("train/nft_loss", series(1.0), series(NEXT_AFTER_ONE))
    assert d is not None
    assert (d.step, d.a, d.b, d.ulps) == (1.0, 1.0, NEXT_AFTER_ONE, 1)


def test_one_ulp_is_the_same_under_a_small_tolerance():
    assert compare_series("k", series(1.0), series(NEXT_AFTER_ONE), rtol=1e-12) is None
    assert compare_series("k", series(1.0), series(NEXT_AFTER_ONE), atol=1e-15) is None


def test_tolerance_is_relative_to_b():
    # |a - b| <= atol + rtol * |b|: b is the reference.
    assert not values_match(2.0, 1.0, rtol=0.75)
    assert values_match(1.0, 2.0, rtol=0.75)


@pytest.mark.parametrize("a, b, ulps", [
    (1.0, NEXT_AFTER_ONE, 1),
    (-0.0, 0.0, 0),
    (-5e-324, 5e-324, 2),  # the two smallest subnormals around zero
    (1.0, 2.0, 2**52),
    (-1.0, -NEXT_AFTER_ONE, 1),
    (-1.0, 1.0, 2 * 0x3FF0_0000_0000_0000),
])
def test_ulp_distance(a, b, ulps):
    assert ulp_distance(a, b) == ulps
    assert ulp_distance(b, a) == ulps


@pytest.mark.parametrize("a, b", [(math.nan, 1.0), (math.inf, 1.0), (math.inf, math.inf), (math.nan, math.nan)])
def test_ulp_distance_is_undefined_for_non_finite_values(a, b):
    assert ulp_distance(a, b) is None


def test_different_step_lists_differ():
    d = compare_series("k", series(1.0, 2.0, 3.0), series(1.0, 2.0))
    assert d.reason == "steps differ: A has [1, 2, 3], B has [1, 2]"
    assert (d.step, d.a, d.b) == (3.0, 3.0, None)


def test_a_step_only_b_has_is_the_first_divergence():
    d = compare_series("k", series(1.0, 2.0, 4.0, steps=[1, 2, 4]), series(1.0, 2.0, 3.0))
    assert (d.step, d.a, d.b) == (3.0, None, 3.0)


def test_long_step_lists_are_shortened_around_the_divergence():
    b = series(*np.zeros(100), steps=range(100))
    a = np.delete(b, 50, axis=0)
    d = compare_series("k", a, b)
    assert d.step == 50.0
    assert d.reason.startswith("steps differ: A has [..., 48, 49, 51,")
    assert "(99 rows)" in d.reason and "(100 rows)" in d.reason


def test_empty_series_match_each_other_only():
    assert compare_series("k", np.zeros((0, 2)), np.zeros((0, 2))) is None
    assert compare_series("k", np.zeros((0, 2)), series(1.0)) is not None


def test_default_keys_are_the_common_non_perf_keys():
    a = {"x": series(1.0), "perf/train_s": series(1.0), "only_a": series(1.0)}
    b = {"x": series(1.0), "perf/train_s": series(2.0), "only_b": series(1.0)}
    result = compare_metrics(a, b)
    assert result.keys == ["x"] and result.same


def test_requested_perf_key_is_compared():
    a, b = {"perf/train_s": series(1.0)}, {"perf/train_s": series(2.0)}
    assert not compare_metrics(a, b, keys=["perf/train_s"]).same


def test_missing_requested_key_is_an_error_naming_the_side():
    with pytest.raises(CompareError, match=r"'y' is not in B"):
        select_keys(["x", "y"], ["x"], ["y"])
    with pytest.raises(CompareError, match=r"'z' is not in A and B"):
        compare_metrics({"x": series(1.0)}, {"x": series(1.0)}, keys=["x", "z"])


def test_no_common_key_is_an_error():
    with pytest.raises(CompareError, match="no metric key in common"):
        compare_metrics({"x": series(1.0)}, {"y": series(1.0)})


@pytest.mark.parametrize("rtol, atol", [(-1.0, 0.0), (0.0, math.nan), (math.inf, 0.0)])
def test_bad_tolerance_is_an_error(rtol, atol):
    with pytest.raises(CompareError):
        compare_metrics({"x": series(1.0)}, {"x": series(1.0)}, rtol=rtol, atol=atol)


def test_malformed_series_is_an_error():
    with pytest.raises(CompareError, match="expected \\(n, 2\\)"):
        compare_metrics({"x": np.zeros((3, 3))}, {"x": np.zeros((3, 3))})


def test_report_lists_every_diverging_key_earliest_first():
    a = {"a": series(1.0, 2.0, 3.0), "b": series(1.0, 2.0, 3.0), "c": series(1.0, 2.0, 3.0)}
    b = {"a": series(1.0, 2.0, 9.0), "b": series(1.0, 9.0, 3.0), "c": series(1.0, 2.0, 3.0)}
    result = compare_metrics(a, b)
    assert [(d.key, d.step) for d in result.divergences] == [("b", 2.0), ("a", 3.0)]
    assert result.verdict == "differ: 2 of 3 keys, first at step 2 (b)"
    assert result.steps == 3


def test_verdict_when_same_counts_keys_and_steps_and_names_the_tolerance():
    a = {"a": series(1.0, 2.0), "b": series(1.0, 2.0, 3.0)}
    assert compare_metrics(a, a).verdict == "same: 2 keys, 3 steps"
    assert compare_metrics(a, a, rtol=1e-9).verdict == "same: 2 keys, 3 steps (rtol=1e-09, atol=0)"


def test_json_form_is_strict_json_with_non_finite_values_as_strings():
    result = compare_metrics({"k": series(math.nan)}, {"k": series(math.inf)})
    doc = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    assert doc["same"] is False
    assert doc["divergences"] == [{"key": "k", "step": 1, "a": "NaN", "b": "Infinity", "ulps": None,
                                   "reason": "values differ"}]


def test_standard_round_trips_bitwise_including_nan_and_infinities():
    metrics = {"b": series(math.nan, math.inf, -math.inf, 0.1, -0.0, 5e-324), "a": series(),
               "c": series(2.5, steps=[0.5])}
    text = dumps_standard(standard_document(metrics, {"commit": "local"}))
    doc = json.loads(text)
    assert list(doc["metrics"]) == ["a", "b", "c"]
    assert doc["metrics"]["b"][:3] == [[1, "NaN"], [2, "Infinity"], [3, "-Infinity"]]
    back = metrics_from_standard(doc)
    assert compare_metrics(metrics, back, keys=["a", "b", "c"]).same
    assert math.copysign(1.0, back["b"][4, 1]) == -1.0  # -0.0 keeps its sign


def test_standard_text_is_indented_with_one_row_per_line():
    text = dumps_standard(standard_document({"k": series(1.0, 2.0)}, {"commit": "local"}))
    assert text == ('{\n  "meta": {\n    "commit": "local"\n  },\n  "metrics": {\n'
                    '    "k": [\n      [1, 1.0],\n      [2, 2.0]\n    ]\n  }\n}\n')


def test_standard_reader_accepts_bare_nan_tokens():
    doc = json.loads('{"metrics": {"k": [[1, NaN], [2, Infinity], [3, -Infinity]]}}')
    assert compare_metrics(metrics_from_standard(doc), {"k": series(math.nan, math.inf, -math.inf)}).same


@pytest.mark.parametrize("doc, message", [
    ([], "not a standard"),
    ({"meta": {}}, "not a standard"),
    ({"metrics": {"k": [[1, 2, 3]]}}, "list of \\[step, value\\] pairs"),
    ({"metrics": {"k": [[1, "nan"]]}}, "'nan' is not a number"),
    ({"metrics": {"k": [[1, True]]}}, "True is not a number"),
])
def test_malformed_standard_is_an_error(doc, message):
    with pytest.raises(CompareError, match=message):
        metrics_from_standard(doc)


# -- runs of different lengths ------------------------------------------------------------
def run_of(steps: int, eval_every: int = 5, loss_at_2: float = 2.0) -> dict:
    """Metrics of a run of `steps` steps: a per-step key, and evals every `eval_every` steps and
    at the end."""
    loss = [float(s) for s in range(1, steps + 1)]
    loss[1] = loss_at_2
    evals = sorted({s for s in range(1, steps + 1) if s % eval_every == 0} | {steps})
    return {"train/nft_loss": series(*loss),
            "eval/pickscore_mean": series(*[0.5 + s for s in evals], steps=evals)}


def test_different_lengths_differ_and_the_verdict_says_so_and_suggests_prefix():
    result = compare_metrics(run_of(3), run_of(9))
    assert not result.same
    assert result.verdict.endswith("the runs' lengths differ (A runs to step 3, B to step 9): "
                                   "--prefix compares their common steps")
    assert result.to_dict()["last_step_a"] == 3 and result.to_dict()["last_step_b"] == 9


def test_prefix_compares_the_common_steps_and_counts_them():
    for a, b, order in ((run_of(3), run_of(9), "A runs to step 3, B to step 9"),
                        (run_of(9), run_of(3), "A runs to step 9, B to step 3")):
        result = compare_metrics(a, b, prefix=True)
        assert result.same, result.divergences
        assert result.verdict == f"same: 2 keys, 3 common steps compared ({order})"


def test_prefix_still_finds_a_difference_inside_the_common_steps():
    result = compare_metrics(run_of(3, loss_at_2=2.5), run_of(9), prefix=True)
    assert not result.same
    assert [(d.key, d.step) for d in result.divergences] == [("train/nft_loss", 2.0)]
    assert "3 common steps compared" in result.verdict


def test_prefix_still_finds_a_row_missing_inside_the_common_steps():
    short = run_of(3)
    short["train/nft_loss"] = short["train/nft_loss"][[0, 2]]  # step 2 lost
    result = compare_metrics(short, run_of(9), prefix=True)
    assert [(d.key, d.step) for d in result.divergences] == [("train/nft_loss", 2.0)]


def test_prefix_keeps_a_periodic_row_at_the_shorter_runs_last_step():
    # the 5-step run's eval at step 5 is also the 9-step run's periodic one: compared, and here it differs
    short = run_of(5)
    short["eval/pickscore_mean"] = series(9.0, steps=[5])
    result = compare_metrics(short, run_of(9), prefix=True)
    assert [(d.key, d.step) for d in result.divergences] == [("eval/pickscore_mean", 5.0)]


def test_same_lengths_keep_the_plain_verdict_with_or_without_prefix():
    assert compare_metrics(run_of(3), run_of(3)).verdict == "same: 2 keys, 3 steps"
    assert compare_metrics(run_of(3), run_of(3), prefix=True).verdict == "same: 2 keys, 3 steps"
    differ = compare_metrics(run_of(3, loss_at_2=7.0), run_of(3)).verdict
    assert "lengths" not in differ and "--prefix" not in differ
