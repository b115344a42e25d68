"""MATH-style scorer: the last `\\boxed{...}` answer, lightly normalised, compared as strings (verl's `math_reward`).

The normalisation is the Hendrycks MATH one verl uses: drop spaces, `\\left`/`\\right`, `\\!`, degree marks, `\\$`,
a trailing `\\text{ unit}`, `\\%`; unify `tfrac`/`dfrac` -> `frac`; add braces to `\\frac12` / `\\sqrt2`; `a/b` ->
`\\frac{a}{b}` for integers; `0.5` -> `\\frac{1}{2}`; a leading `.5` -> `0.5`; drop a short `x = ` prefix. It is not a
symbolic checker: `1/3` and `0.333` differ. Use a custom reward (e.g. math-verify) for symbolic equivalence.
"""

from __future__ import annotations

import re


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed x`), braces balanced; None if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    if rest.startswith("\\boxed "):  # `\boxed 5` form
        return rest[len("\\boxed "):].split("$")[0].strip()
    open_at = rest.find("{")
    if open_at < 0:
        return None
    depth = 0
    for i in range(open_at, len(rest)):
        depth += {"{": 1, "}": -1}.get(rest[i], 0)
        if depth == 0:
            return rest[open_at + 1 : i]
    return None  # unbalanced: the response was cut off inside the box


def _fix_fracs(s: str) -> str:
    parts = s.split("\\frac")
    out = parts[0]
    for p in parts[1:]:
        out += "\\frac"
        if p.startswith("{") or len(p) < 2:
            out += p
        elif p[1] == "{":
            out += "{" + p[0] + "}" + p[1:]
        else:
            out += "{" + p[0] + "}{" + p[1] + "}" + p[2:]
    return out


def _fix_a_slash_b(s: str) -> str:
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    return f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}" if m else s


def normalize(s: str) -> str:
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac").replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    if "\\text{ " in s:  # trailing unit, e.g. "5\text{ cm}"
        s = s.split("\\text{ ")[0]
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    lhs = s.split("=")
    if len(lhs) == 2 and len(lhs[0].strip()) <= 2:  # "x = 5" -> "5"
        s = lhs[1]
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_a_slash_b(s)


def compute_score(solution_str: str, ground_truth: str) -> float:
    answer = last_boxed(solution_str)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    truth = last_boxed(truth) if "\\boxed" in truth else truth  # some datasets keep the full boxed solution
    return 1.0 if truth is not None and normalize(answer) == normalize(truth) else 0.0
