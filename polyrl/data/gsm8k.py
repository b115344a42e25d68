"""Convert a local GSM8K-format jsonl (`question`, `answer` ending in '#### N') to verl's parquet schema.

Matches verl's `examples/data_preprocess/gsm8k.py` row for row: the instruction suffix, ground truth = the number after
'#### ' with commas removed, data_source 'openai/gsm8k', ability 'math', extra_info {split, index, answer, question}.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from polyrl.errors import DataError

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_ANSWER_RE = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_answer(answer: str) -> str | None:
    """The final number after '#### ' with thousands separators removed, or None when there is none."""
    m = _ANSWER_RE.search(answer)
    return m.group(1).replace(",", "") if m else None


def to_row(question: str, answer: str, split: str, index: int) -> dict:
    solution = extract_answer(answer)
    if solution is None:
        raise DataError(
            f"GSM8K example {index}: its answer has no '#### N' final number ({answer[-60:]!r}); fix or drop it."
        )
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": solution},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def convert_jsonl(path: str | Path, split: str = "train") -> list[dict]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(
            f"GSM8K file '{path}' does not exist; pass a local jsonl with 'question' and 'answer' per line."
        )
    rows = []
    for lineno, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            ex = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"Line {lineno} of '{path}' is not valid JSON ({e.msg}); fix that line.") from e
        if not isinstance(ex, dict) or not isinstance(ex.get("question"), str) or not isinstance(ex.get("answer"), str):
            raise DataError(
                f"Line {lineno} of '{path}' needs string fields 'question' and 'answer'; got {str(ex)[:80]}."
            )
        try:
            rows.append(to_row(ex["question"], ex["answer"], split, len(rows)))
        except DataError as e:
            raise DataError(f"Line {lineno} of '{path}' has no '#### N' final answer; fix or drop that line.") from e
    if not rows:
        raise DataError(f"GSM8K file '{path}' holds no examples; pass a non-empty jsonl.")
    return rows
