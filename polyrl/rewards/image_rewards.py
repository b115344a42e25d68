"""Image rewards: `fn(images, prompts, metadata) -> scores`, images a float tensor [B, C, H, W] in [0, 1].

Built-ins live in a name->factory registry (`REWARDS`): `ocr` (flow_grpo's formula on rapidocr's transcription).
A VLM judge (`reward.reward_model.*`, rewards/vlm_judge.py) joins as the component `reward_model`.
The quickstart registers its digit classifier at run time. `load_custom` imports a user function by file path;
`weighted` combines several into sum_i w_i * r_i and reports each component (`reward/<name>`) for logging.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import torch

from polyrl.errors import RewardError

RewardFn = Callable[[torch.Tensor, list[str], list[dict]], "torch.Tensor | list[float]"]
REWARDS: dict[str, Callable[[], RewardFn]] = {}


def register_reward(name: str):
    """Register a zero-argument factory returning a reward fn (factories let heavy engines load lazily)."""

    def decorator(factory):
        REWARDS[name] = factory
        return factory

    return decorator


# --------------------------------------------------------------------------- OCR


def levenshtein(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def ocr_score(transcription: str, ground_truth: str) -> float:
    """flow_grpo: whitespace removed, lower-cased; 1 if gt is inside the text, else 1 - min(Lev, |gt|) / |gt|."""
    pred = re.sub(r"\s+", "", transcription).lower()
    gt = re.sub(r"\s+", "", ground_truth).lower()
    if not gt:
        return 0.0
    if gt in pred:
        return 1.0
    return 1.0 - min(levenshtein(pred, gt), len(gt)) / len(gt)


def ground_truth_of(prompt: str, meta: dict) -> str:
    """metadata['ground_truth'], else the text between the prompt's first pair of double quotes."""
    if meta and meta.get("ground_truth") is not None:
        return str(meta["ground_truth"])
    m = re.search(r'"([^"]*)"', prompt)
    if m is None:
        raise RewardError(f'OCR reward: prompt {prompt!r} has no "quoted" text and no metadata ground_truth; add one.')
    return m.group(1)


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """[B, C, H, W] floats in [0, 1] -> [B, H, W, 3] uint8 (greyscale is repeated)."""
    x = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()
    if x.shape[1] == 1:
        x = x.repeat(1, 3, 1, 1)
    return x.permute(0, 2, 3, 1).numpy()


def ocr_threads() -> int:
    """onnxruntime threads for one OCR engine: the async scorer's budget for its workers (POLYRL_REWARD_THREADS), else
    this process's share of the host's cores (one engine per torchrun process scoring in its step)."""
    import os

    from polyrl.rewards.async_scorer import REWARD_THREADS
    from polyrl.utils.device import cpu_share

    return int(os.environ.get(REWARD_THREADS) or cpu_share())


class OCRReward:
    """rapidocr (PP-OCR ONNX models shipped in the wheel) with Det.limit_type="max" (research/env-probe.md §4)."""

    def __init__(self, limit_side_len: int = 736, threads: int | None = None):
        try:
            from rapidocr import RapidOCR
        except ImportError as e:
            raise RewardError("The ocr reward needs rapidocr and onnxruntime; run `pip install rapidocr onnxruntime`.") from e
        self.threads = threads or ocr_threads()
        self.engine = RapidOCR(params={"Det.limit_type": "max", "Det.limit_side_len": limit_side_len,
                                       "Global.log_level": "error",
                                       "EngineConfig.onnxruntime.intra_op_num_threads": self.threads,
                                       "EngineConfig.onnxruntime.inter_op_num_threads": 1})  # fmt: skip

    def read(self, image_hw3: np.ndarray) -> str:
        r = self.engine(image_hw3)
        if r is None or not r.txts:
            return ""
        return " ".join(t for _, t in sorted(zip(r.boxes, r.txts), key=lambda b: b[0][0][0]))

    def __call__(self, images, prompts, metadata):
        arrays = to_uint8(images)
        return [ocr_score(self.read(a), ground_truth_of(p, m)) for a, p, m in zip(arrays, prompts, metadata)]


@register_reward("ocr")
def _ocr_factory():
    return OCRReward()


# --------------------------------------------------------------------------- custom and combined


def load_custom(path: str, name: str = "compute_score") -> RewardFn:
    """Import `name` from the Python file at `path` (reward.custom_reward_function.{path,name}); the LLM trainer's
    loader (polyrl.rewards.custom), with this trainer's key in its errors."""
    from polyrl.rewards.custom import load_custom_reward

    return load_custom_reward(path, name, key="reward.custom_reward_function")


def as_scores(value, batch: int, name: str) -> torch.Tensor:
    """Check a reward fn's output: `batch` finite numbers."""
    scores = torch.as_tensor(value, dtype=torch.float32).reshape(-1)
    if scores.numel() != batch:
        raise RewardError(f"reward {name!r} returned {scores.numel()} scores for {batch} images; return one per image.")
    if not torch.isfinite(scores).all():
        raise RewardError(f"reward {name!r} returned a non-finite score ({scores.tolist()}); return finite numbers.")
    return scores


class WeightedReward:
    """sum_i w_i * fn_i(images, prompts, metadata); `last_components` keeps each term's mean for logging."""

    def __init__(self, fns: dict[str, RewardFn], weights: dict[str, float]):
        if not fns:
            raise RewardError("No reward function configured; set reward.reward_fns or reward.custom_reward_function.path.")
        self.fns, self.weights = fns, weights
        self.last_components: dict[str, float] = {}

    def __call__(self, images, prompts, metadata) -> torch.Tensor:
        total = torch.zeros(len(prompts))
        for name, fn in self.fns.items():
            scores = as_scores(fn(images, prompts, metadata), len(prompts), name)
            self.last_components[f"reward/{name}"] = float(scores.mean())
            self.last_components.update(getattr(fn, "pop_metrics", dict)())  # a judge's parse failures
            total += self.weights.get(name, 1.0) * scores
        return total


def build_reward(reward_fns: dict[str, float], custom_path: str | None = None, custom_name: str = "compute_score",
                 extra: dict[str, RewardFn] | None = None, judge=None) -> WeightedReward:  # fmt: skip
    """The configured reward: built-ins by name with weights, plus `extra` (task rewards), a custom fn and a VLM
    judge (`judge`, a `vlm_judge.VLMJudgeSpec`: the `reward_model` component)."""
    available = dict(extra or {})
    fns, weights = {}, {}
    for name, w in reward_fns.items():
        if (name == "custom" and custom_path) or (name == "reward_model" and judge is not None):
            continue  # the weight of the custom fn or the judge, added below
        if name in available:
            fns[name] = available[name]
        elif name in REWARDS:
            fns[name] = REWARDS[name]()
        else:
            raise RewardError(f"reward.reward_fns has unknown reward {name!r}; use one of {sorted(set(REWARDS) | set(available))}.")
        weights[name] = float(w)
    if custom_path:
        fns["custom"] = load_custom(custom_path, custom_name)
        weights["custom"] = float(reward_fns.get("custom", 1.0))
    if judge is not None:
        from polyrl.rewards.vlm_judge import VLMJudge

        fns["reward_model"] = VLMJudge(judge)
        weights["reward_model"] = float(reward_fns.get("reward_model", 1.0))
    return WeightedReward(fns, weights)
