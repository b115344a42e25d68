"""Built-in synthetic tasks for the embedded defaults: verl-schema rows plus an exact-match rule scorer each.

Prompts are a handful of characters so a char-tokenizer model on a CPU can learn them in minutes.

Train and validation prompts never overlap, whatever the seeds: a prompt belongs to the validation split when a
stable hash of its text falls in the held-out 20% (`is_heldout`), and each split only draws from its own side. So a
training set made with seed 1 and a validation set made with seed 2 are still disjoint.

The scorers compare the stripped response with the ground truth: `solution_str` is the decoded response without
special tokens (the reward manager's caller decodes with `skip_special_tokens=True`). `word_addition` is the one
task for real chat models (SmolLM2-135M-Instruct): a question in words, scored on the last number of the answer.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Callable

from polyrl.errors import DataError

HELDOUT_PERCENT = 20


def exact_match(solution_str: str, ground_truth: str) -> float:
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0


def last_number_match(solution_str: str, ground_truth: str) -> float:
    """1.0 when the last integer in the text equals the ground truth ('12 + 30 = 42' counts; '42.' counts)."""
    numbers = re.findall(r"-?\d+", solution_str)
    return 1.0 if numbers and numbers[-1] == str(ground_truth).strip() else 0.0


@dataclass(frozen=True)
class SyntheticTask:
    name: str
    data_source: str
    ability: str
    make: Callable[[random.Random], tuple[str, str]]
    """Draws one (prompt text, answer) pair."""
    description: str
    match: Callable[[str, str], float] = exact_match
    """Scores a decoded response against the ground truth."""

    def score(self, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
        return self.match(solution_str, ground_truth)


def last_line_match(solution_str: str, ground_truth: str) -> float:
    """1.0 when the response's last line is the ground truth: with tool turns in the response (decoded without
    special tokens), the final answer after them, not a number the tool printed."""
    lines = solution_str.strip().splitlines()
    return 1.0 if lines and lines[-1].strip() == str(ground_truth).strip() else 0.0


def _multiply(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    return f"{a}*{b}=", str(a * b)


def _addition(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"{a}+{b}=", str(a + b)


def _word_addition(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(1, 60), rng.randint(1, 60)
    return f"What is {a} + {b}? Answer with only the number.", str(a + b)


_LETTERS = "abcdefgh"


def _reverse(rng: random.Random) -> tuple[str, str]:
    s = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(3, 5)))
    return f"rev {s}=", s[::-1]


def _count(rng: random.Random) -> tuple[str, str]:
    target = rng.choice("abc")
    s = "".join(rng.choice("abc") for _ in range(rng.randint(4, 7)))
    return f"#{target} {s}=", str(s.count(target))


TASKS: dict[str, SyntheticTask] = {
    t.name: t
    for t in [
        SyntheticTask("addition", "polyrl/addition", "arithmetic", _addition, "two-digit a+b, e.g. '23+45=' -> '68'"),
        SyntheticTask("reverse", "polyrl/reverse", "string", _reverse, "reverse 3-5 letters, e.g. 'rev abc=' -> 'cba'"),
        SyntheticTask("count", "polyrl/count", "counting", _count, "count a letter, e.g. '#a abca=' -> '2'"),
        SyntheticTask("multiply", "polyrl/multiply", "arithmetic", _multiply,
                      "3-digit a*b, e.g. '123*456=' -> '56088': beyond a tiny model, easy with a calculator tool "
                      "(`polyrl quickstart --task tools`); scored on the last line", match=last_line_match),
        SyntheticTask("word_addition", "polyrl/word_addition", "arithmetic", _word_addition,
                      "a, b in 1..60 asked in words for chat models; the answer's last number must be a+b",
                      match=last_number_match),
    ]
}
TASKS_BY_SOURCE = {t.data_source: t for t in TASKS.values()}


def get_task(name: str) -> SyntheticTask:
    if name not in TASKS:
        raise DataError(f"Unknown synthetic task '{name}'; choose one of: {', '.join(TASKS)}.")
    return TASKS[name]


def is_heldout(prompt: str) -> bool:
    """Whether a prompt belongs to the validation split (stable across processes, unlike `hash`)."""
    return int(hashlib.md5(prompt.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def make_rows(task: str, num: int, seed: int = 0, split: str = "train") -> list[dict]:
    """`num` distinct verl-schema rows of `task` from one split ('train', or 'val'/'test' for held-out prompts)."""
    t = get_task(task)
    if split not in ("train", "val", "test"):
        raise DataError(f"Unknown split '{split}'; use 'train', 'val' or 'test'.")
    heldout = split != "train"
    rng = random.Random(f"{task}:{split}:{seed}")
    seen: dict[str, str] = {}
    misses = 0  # rejection sampling; a long run of draws with nothing new means the split is used up
    while len(seen) < num and misses < 20_000:
        prompt, answer = t.make(rng)
        if is_heldout(prompt) == heldout and prompt not in seen:
            seen[prompt], misses = answer, 0
        else:
            misses += 1
    if len(seen) < num:
        raise DataError(
            f"Task '{task}' has only about {len(seen)} distinct '{split}' prompts; ask for at most that many."
        )
    return [
        {
            "data_source": t.data_source,
            "prompt": [{"role": "user", "content": prompt}],
            "ability": t.ability,
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": i},
        }
        for i, (prompt, answer) in enumerate(seen.items())
    ]
