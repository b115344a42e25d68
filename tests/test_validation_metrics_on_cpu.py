"""Validation metrics: hand-computed cases, expectations of the bootstrap, and equality with verl's loop."""

from collections import defaultdict

import numpy as np
import pytest

from polyrl.algorithms import process_validation_metrics, validation_metrics_by_source
from polyrl.algorithms.validation import bootstrap_ns


def verl_reference(vals, preds, n, seed=42):
    """verl's bootstrap_metric + calc_maj_val for one prompt, written as verl's loops (global RNG, dict votes)."""
    state = np.random.get_state()
    try:
        out = {}
        for fn_name, fn in (("best", np.max), ("worst", np.min)):
            np.random.seed(seed)
            idx = np.random.choice(len(vals), size=(1000, n), replace=True)
            res = [fn(np.asarray(vals)[row]) for row in idx]
            out[f"{fn_name}@{n}/mean"], out[f"{fn_name}@{n}/std"] = np.mean(res), np.std(res)
        if preds is not None:
            np.random.seed(seed)
            idx = np.random.choice(len(vals), size=(1000, n), replace=True)
            res = []
            for row in idx:
                vote2vals = defaultdict(list)
                for i in row:
                    vote2vals[preds[i]].append(vals[i])
                counts = {k: len(v) for k, v in vote2vals.items()}
                res.append(vote2vals[max(counts, key=counts.get)][0])
            out[f"maj@{n}/mean"], out[f"maj@{n}/std"] = np.mean(res), np.std(res)
        return out
    finally:
        np.random.set_state(state)


def test_bootstrap_sizes():
    assert bootstrap_ns(1) == []
    assert bootstrap_ns(2) == [2]
    assert bootstrap_ns(5) == [2, 4, 5]
    assert bootstrap_ns(8) == [2, 4, 8]


def test_constant_prompt_hand_values():
    # two samples both correct: every statistic is 1, spreads are 0
    m = validation_metrics_by_source(["gsm8k"] * 2, ["q"] * 2, {"acc": [1.0, 1.0], "pred": ["7", "7"]})
    acc = m["gsm8k"]["acc"]
    assert acc == {
        "mean@2": 1.0, "std@2": 0.0,
        "best@2/mean": 1.0, "best@2/std": 0.0, "worst@2/mean": 1.0, "worst@2/std": 0.0,
        "maj@2/mean": 1.0, "maj@2/std": 0.0,
    }  # fmt: skip
    assert "pred" not in m["gsm8k"]  # text fields carry no statistic


def test_single_sample_gives_only_mean_at_1():
    out = process_validation_metrics(["ds"], ["q"], {"reward": [0.5]})
    assert out == {"val-core/ds/reward/mean@1": 0.5}


def test_bootstrap_expectations_and_verl_equality():
    # prompt with vals [1, 0]: best@2 -> 1 - P(both draws 0) = .75; worst@2 -> P(both 1) = .25
    # prompt with preds [a, a, b], vals [1, 1, 0]: maj@3 is 0 only when b (1/3 per draw) wins >= 2 of 3 draws:
    #   3*(1/3)^2*(2/3) + (1/3)^3 = 7/27, so E[maj@3] = 20/27 = .7407
    m = validation_metrics_by_source(["s"] * 2, ["p"] * 2, {"acc": [1.0, 0.0]})["s"]["acc"]
    assert m["mean@2"] == 0.5 and m["std@2"] == 0.5
    assert m["best@2/mean"] == pytest.approx(0.75, abs=0.04)
    assert m["worst@2/mean"] == pytest.approx(0.25, abs=0.04)
    ref = verl_reference([1.0, 0.0], None, 2)
    for k, v in ref.items():
        assert m[k] == pytest.approx(v, abs=1e-12), k

    vals, preds = [1.0, 1.0, 0.0], ["a", "a", "b"]
    m = validation_metrics_by_source(["s"] * 3, ["p"] * 3, {"acc": vals, "pred": preds})["s"]["acc"]
    assert m["maj@3/mean"] == pytest.approx(20 / 27, abs=0.04)
    for n in (2, 3):
        for k, v in verl_reference(vals, preds, n).items():
            assert m[k] == pytest.approx(v, abs=1e-12), k


def test_majority_tie_goes_to_first_prediction_in_the_draw():
    # n=2, preds differ: every draw of two distinct samples is a 1-1 tie, won by whichever was drawn first
    vals, preds = [1.0, 0.0, 0.5, 0.25], ["x", "y", "z", "x"]
    m = validation_metrics_by_source(["s"] * 4, ["p"] * 4, {"score": vals, "pred": preds})["s"]["score"]
    for n in (2, 4):
        for k, v in verl_reference(vals, preds, n).items():
            assert m[k] == pytest.approx(v, abs=1e-12), k


def test_prompts_are_averaged_and_core_aux_split():
    # prompt A acc [1,0,1,1] (mean .75), prompt B acc [0,0,0,0] (mean 0) -> mean@4 = .375
    sources = ["math"] * 8
    inputs = ["A"] * 4 + ["B"] * 4
    infos = {
        "acc": [1, 0, 1, 1, 0, 0, 0, 0],
        "reward": [1.0, -1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0],
        "pred": ["4", "5", "4", "4", "1", "2", "3", "1"],
    }
    out = process_validation_metrics(sources, inputs, infos)
    assert out["val-core/math/acc/mean@4"] == 0.375
    ref_a = verl_reference([1, 0, 1, 1], ["4", "5", "4", "4"], 4)
    # B is all zeros, so its best/maj are 0 and the source value is A's / 2
    assert out["val-core/math/acc/best@4/mean"] == pytest.approx(ref_a["best@4/mean"] / 2, abs=1e-12)
    assert out["val-core/math/acc/maj@4/mean"] == pytest.approx(ref_a["maj@4/mean"] / 2, abs=1e-12)
    core = {k for k in out if k.startswith("val-core/")}
    # verl's rule: main variable, name starting with mean/best/maj, at the largest N (so the /std entries too)
    assert core == {
        "val-core/math/acc/mean@4",
        "val-core/math/acc/best@4/mean", "val-core/math/acc/best@4/std",
        "val-core/math/acc/maj@4/mean", "val-core/math/acc/maj@4/std",
    }  # fmt: skip
    assert "val-aux/math/acc/std@4" in out and "val-aux/math/acc/best@2/mean" in out
    assert "val-aux/math/acc/worst@4/mean" in out
    assert out["val-aux/math/reward/mean@4"] == pytest.approx((0.5 + -1.0) / 2)
    # without acc, reward is the main variable
    no_acc = process_validation_metrics(sources, inputs, {"reward": infos["reward"]})
    assert "val-core/math/reward/mean@4" in no_acc


def test_data_sources_are_separate_and_global_rng_untouched():
    state = np.random.get_state()[1].copy()
    out = process_validation_metrics(["a", "a", "b", "b"], ["p", "p", "p", "p"], {"acc": [1, 1, 0, 0]})
    assert out["val-core/a/acc/mean@2"] == 1.0
    assert out["val-core/b/acc/mean@2"] == 0.0
    assert np.array_equal(np.random.get_state()[1], state)


def test_length_mismatch_is_reported():
    with pytest.raises(ValueError, match=r"infos\['acc'\] has 1 values"):
        process_validation_metrics(["a", "a"], ["p", "p"], {"acc": [1]})
