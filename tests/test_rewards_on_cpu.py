import math
import time

import pytest
import torch

from polyrl.algorithms.dapo import overlong_penalty
from polyrl.errors import RewardError
from polyrl.rewards import (CustomRewardConfig, OverlongBufferConfig, RewardManager, build_reward_fn,
                            default_compute_score, load_custom_reward)
from polyrl.rewards import boxed, gsm8k

# ------------------------------------------------------------------------------------------------ rule scorers


@pytest.mark.parametrize(
    "source, response, truth, expected",
    [
        ("polyrl/addition", "68", "68", 1.0),
        ("polyrl/addition", " 68\n", "68", 1.0),
        ("polyrl/addition", "69", "68", 0.0),
        ("polyrl/addition", "680", "68", 0.0),
        ("polyrl/reverse", "cba", "cba", 1.0),
        ("polyrl/count", "2", "3", 0.0),
        ("openai/gsm8k", "3 + 4 = 7 so\n#### 7", "7", 1.0),
        ("openai/gsm8k", "#### 1,500", "1500", 1.0),
        ("openai/gsm8k", "#### -3", "-3", 1.0),
        ("openai/gsm8k", "the answer is 7", "7", 0.0),  # strict: no '####', no reward
        ("openai/gsm8k", "#### 8", "7", 0.0),
        ("lighteval/MATH", "so $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}", 1.0),
        ("DigitalLearningGmbH/MATH-lighteval", "\\boxed{\\dfrac12}", "\\frac{1}{2}", 1.0),
        ("math", "\\boxed{1/2}", "\\frac{1}{2}", 1.0),
        ("math", "\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("math", "first \\boxed{3} then \\boxed{4}", "4", 1.0),  # the last box counts
        ("math", "\\boxed{x = 5}", "5", 1.0),
        ("math", "\\boxed{10^{\\circ}}", "10", 1.0),
        ("math", "\\boxed{5\\text{ cm}}", "5", 1.0),
        ("math", "\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),
        ("math", "\\boxed{3}", "4", 0.0),
        ("math", "no box: 4", "4", 0.0),
        ("math", "cut off \\boxed{4", "4", 0.0),
        ("math", "\\boxed{4}", "\\boxed{4}", 1.0),
    ],
)
def test_default_compute_score_on_hand_examples(source, response, truth, expected):
    assert default_compute_score(source, response, truth, None) == expected


def test_gsm8k_flexible_takes_last_number_like_verl():
    assert gsm8k.compute_score("I think 3 then 7.", "7", method="flexible") == 0.0  # '7.' kept like verl
    assert gsm8k.compute_score("I think 3 then 7", "7", method="flexible") == 1.0
    assert gsm8k.extract_solution("no numbers here", "flexible") is None
    assert gsm8k.extract_solution("#### $12", "strict") is None  # the regex needs a digit after '#### '


def test_last_boxed_handles_nesting_and_fbox():
    assert boxed.last_boxed("\\boxed{\\frac{a}{\\sqrt{2}}}") == "\\frac{a}{\\sqrt{2}}"
    assert boxed.last_boxed("\\fbox{7}") == "7"
    assert boxed.last_boxed("$\\boxed 9$") == "9"
    assert boxed.last_boxed("none") is None


def test_unknown_data_source_names_it_and_the_fix():
    with pytest.raises(RewardError) as e:
        default_compute_score("my/dataset", "x", "y")
    assert "'my/dataset'" in str(e.value) and "custom_reward_function.path" in str(e.value)


# ------------------------------------------------------------------------------------------------ custom rewards


def _reward_file(tmp_path, body, name="my_reward.py"):
    p = tmp_path / name
    p.write_text(body)
    return str(p)


FLOAT_FN = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" \
           "    return float(solution_str == ground_truth)\n"
DICT_FN = "def my_fn(data_source, solution_str, ground_truth, extra_info=None):\n" \
          "    return {'score': 2.0 if solution_str == ground_truth else -1.0, 'acc': solution_str == ground_truth,\n" \
          "            'len': len(solution_str), 'pred': solution_str}\n"


def test_custom_reward_float_return(tmp_path):
    fn = build_reward_fn(CustomRewardConfig(path=_reward_file(tmp_path, FLOAT_FN)))
    scores, extras = RewardManager(fn).score([("d", "a", "a", {}), ("d", "b", "a", None)])
    assert scores == [1.0, 0.0] and extras == {}


def test_custom_reward_dict_return_logs_numeric_extras(tmp_path):
    fn = load_custom_reward(_reward_file(tmp_path, DICT_FN), "my_fn")
    scores, extras = RewardManager(fn).score([("d", "a", "a", {}), ("d", "bb", "a", {})])
    assert scores == [2.0, -1.0]
    assert extras == {"acc": [1.0, 0.0], "len": [1.0, 2.0]}  # 'pred' is a string: not a metric


def test_two_custom_files_with_the_same_name_do_not_shadow(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    fa = load_custom_reward(_reward_file(tmp_path / "a", "def compute_score(*a): return 1.0\n", "r.py"))
    fb = load_custom_reward(_reward_file(tmp_path / "b", "def compute_score(*a): return 2.0\n", "r.py"))
    assert fa("d", "", "", None) == 1.0 and fb("d", "", "", None) == 2.0


def test_build_reward_fn_defaults_to_rules():
    assert build_reward_fn(CustomRewardConfig()) is default_compute_score


def test_custom_reward_file_missing(tmp_path):
    with pytest.raises(RewardError, match=r"custom_reward_function.path '.*nope.py' does not exist"):
        load_custom_reward(str(tmp_path / "nope.py"))


def test_custom_reward_function_missing_lists_callables(tmp_path):
    body = "import os\ndef reward_a(*a): return 0\ndef reward_b(*a): return 0\nX = 3\n"
    with pytest.raises(RewardError) as e:
        load_custom_reward(_reward_file(tmp_path, body), "compute_score")
    msg = str(e.value)
    assert "'compute_score' is not defined" in msg and "my_reward.py" in msg
    assert "reward_a, reward_b" in msg and "os" not in msg.split("functions:")[1]
    assert "custom_reward_function.name" in msg


def test_custom_reward_file_that_fails_to_import(tmp_path):
    with pytest.raises(RewardError, match="Importing custom reward file .* raised ZeroDivisionError"):
        load_custom_reward(_reward_file(tmp_path, "x = 1 / 0\n"))


# ------------------------------------------------------------------------------------------------ manager errors

RAISING_FN = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" \
             "    if solution_str == 'boom':\n        raise KeyError('answer')\n    return 1.0\n"


def test_raising_reward_names_function_file_sample_and_source(tmp_path):
    path = _reward_file(tmp_path, RAISING_FN)
    mgr = RewardManager(load_custom_reward(path))
    with pytest.raises(RewardError) as e:
        mgr.score([("ok/src", "fine", "1", {}), ("bad/src", "boom", "1", {})])
    msg = str(e.value)
    assert "'compute_score'" in msg and path in msg and "sample 1" in msg and "data_source='bad/src'" in msg
    assert "KeyError" in msg and "'answer'" in msg
    assert isinstance(e.value.__cause__, KeyError)


@pytest.mark.parametrize(
    "ret, what",
    [("float('nan')", "returned nan"), ("float('inf')", "returned inf"), ("'1.0'", "not a number"),
     ("None", "not a number"), ("{'score': float('nan')}", "returned nan"), ("{'acc': 1}", "without a 'score' key")],
)
def test_bad_reward_values(tmp_path, ret, what):
    path = _reward_file(tmp_path, f"def compute_score(*a):\n    return {ret}\n")
    with pytest.raises(RewardError) as e:
        RewardManager(load_custom_reward(path)).score([("src", "x", "y", None)])
    assert what in str(e.value) and "sample 0" in str(e.value) and "data_source='src'" in str(e.value)


def test_inconsistent_extra_keys_are_refused():
    def fn(ds, s, gt, extra):
        return {"score": 1.0, "a": 1} if s == "x" else {"score": 0.0, "b": 1}

    with pytest.raises(RewardError, match=r"not sample 0.s \[.a.\], on sample 1 .*same keys"):
        RewardManager(fn).score([("d", "x", "", None), ("d", "y", "", None)])


def test_unknown_data_source_through_manager_keeps_the_clear_message():
    with pytest.raises(RewardError, match="No built-in reward for data_source 'who'"):
        RewardManager(default_compute_score).score([("who", "x", "y", None)])


# ------------------------------------------------------------------------------------------------ overlong


def test_overlong_penalty_matches_dapo_formula():
    cfg = OverlongBufferConfig(enable=True, len=4, penalty_factor=1.0, log=True)
    # max 10, buffer 4: free up to 6 tokens, then -0.25 per token down to -1 at 10
    lengths = torch.tensor([3, 6, 7, 8, 10])
    assert overlong_penalty(lengths, 10, cfg.len, cfg.penalty_factor).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
    mgr = RewardManager(default_compute_score, overlong_buffer=cfg, max_response_length=10)
    scores, extras = mgr.score([("polyrl/addition", "5", "5", None)] * 2, response_lengths=[2, 9])
    assert scores == [1.0, 0.25]
    assert extras == {"overlong_reward": [0.0, -0.75], "overlong": [0.0, 1.0]}


def test_overlong_disabled_changes_nothing_and_bad_len_is_refused():
    mgr = RewardManager(default_compute_score, overlong_buffer=OverlongBufferConfig(enable=False, len=4))
    assert mgr.score([("polyrl/addition", "5", "5", None)], response_lengths=[100])[0] == [1.0]
    with pytest.raises(RewardError, match="overlong_buffer.len=0"):
        RewardManager(default_compute_score, overlong_buffer=OverlongBufferConfig(enable=True, len=0),
                      max_response_length=8)


def test_rule_scoring_is_fast_enough_to_stay_serial():
    samples = [("openai/gsm8k", "step by step ... #### 42", "42", None)] * 5000
    t0 = time.perf_counter()
    scores, _ = RewardManager(default_compute_score).score(samples)
    per_sample_us = (time.perf_counter() - t0) / len(samples) * 1e6
    assert sum(scores) == 5000 and not math.isnan(per_sample_us)
    assert per_sample_us < 200  # a rollout costs milliseconds per sample; scoring must stay far below
