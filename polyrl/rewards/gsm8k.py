"""GSM8K scorer, as verl's `reward_score/gsm8k.py`: 1.0 when the extracted final number equals the ground truth.

'strict' needs the '#### N' format the data's instruction asks for (so it also rewards following the format);
'flexible' takes the last number anywhere in the response.
"""

from __future__ import annotations

import re

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    if method == "strict":
        m = _STRICT.search(solution_str)
        return m.group(1).replace(",", "").replace("$", "") if m else None
    if method == "flexible":
        numbers = [n for n in _NUMBER.findall(solution_str) if n not in ("", ".")]
        return numbers[-1] if numbers else None
    raise ValueError(f"gsm8k extraction method {method!r} is not 'strict' or 'flexible'")


def compute_score(solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> float:
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == str(ground_truth) else format_score
