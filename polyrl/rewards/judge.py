"""Generative judge: a causal LM reads the question and the response and writes a verdict that a parser turns into a
score. It decodes on polyrl's native engine (never HF generate), on CPU or GPU.

The user's judge file (`reward_model.judge.path`, like `custom_reward_function.path`) defines the two task-specific
parts that verl leaves to a custom reward function:
- a template string (`judge.template`, default `JUDGE_TEMPLATE`): the judge's user message, with `{question}` (the
  prompt's last user turn), `{response}` (the policy's decoded response) and optionally `{reference}` (the row's
  ground truth). Only those three placeholders are replaced, so other braces in the text (JSON examples) stay as
  written. The message is rendered with the judge's chat template (generation prompt on) when it has one.
- a parser (`judge.parser`, default `parse_score`): `parse_score(answer: str) -> float | None`.

An answer the parser cannot read (None, an exception, or not a finite number) scores `judge.default_score` and is
counted (`reward/judge_parse_failures`); it never stops the run. The first parser exception is printed once, since a
parser that always raises would otherwise look like a judge that never answers.

The judge may be the policy's own directory: it is then a frozen copy of the initial policy. Colocated, it sleeps
between calls (weights in host memory, KV cache freed: `NativeEngine.release_memory(offload_weights=True)`).
"""

from __future__ import annotations

import math

import torch

from polyrl.errors import ConfigError
from polyrl.rewards.config import JudgeConfig, RewardModelRolloutConfig

PLACEHOLDERS = ("{question}", "{response}", "{reference}")


def load_judge_file(judge: JudgeConfig, key: str):
    """(template, parser) from the judge file; one sentence for anything missing or malformed."""
    from polyrl.rewards.custom import load_module

    module = load_module(judge.path, f"'{judge.template}' and '{judge.parser}'", f"{key}.judge")
    template, parser = getattr(module, judge.template, None), getattr(module, judge.parser, None)
    if not isinstance(template, str):
        raise ConfigError(f"Judge file '{judge.path}' defines no string '{judge.template}' ({key}.judge.template); "
                          "define the judge's prompt there, with {question} and {response} in it.")
    if "{response}" not in template:
        raise ConfigError(f"Judge template '{judge.template}' in '{judge.path}' has no {{response}} placeholder, so "
                          "the judge would never see the response; add {response} (and {question}) to it.")
    if not callable(parser):
        raise ConfigError(f"Judge file '{judge.path}' defines no function '{judge.parser}' ({key}.judge.parser); "
                          "define parse_score(answer: str) -> float | None there.")
    return template, parser


def fill(template: str, question: str, response: str, reference: str) -> str:
    for name, value in zip(PLACEHOLDERS, (question, response, reference)):
        template = template.replace(name, value)
    return template


def last_user_turn(chat: list[dict]) -> str:
    users = [m["content"] for m in chat if m.get("role") == "user"]
    return str(users[-1]) if users else ""


class Verdicts:
    """Judge answers to scores with the judge file's parser; an answer it cannot read scores `default_score`."""

    def __init__(self, parser, default_score: float):
        self.parser, self.default_score = parser, default_score
        self.warned = False

    def parse(self, answer: str) -> float | None:
        try:
            value = self.parser(answer)
            value = None if value is None else float(value)
        except Exception as e:  # a judge's odd answer must not stop training (counted as a parse failure)
            if not self.warned:
                print(f"polyrl: judge parser raised {type(e).__name__}: {e} on {answer!r:.80}; such answers score "
                      f"{self.default_score} (reward/judge_parse_failures counts them)", flush=True)
                self.warned = True
            return None
        return value if value is not None and math.isfinite(value) else None

    def read(self, answers: list[str]) -> tuple[list[float], list[bool]]:
        """A score per answer, and whether it failed to parse."""
        parsed = [self.parse(a) for a in answers]
        return [self.default_score if v is None else v for v in parsed], [v is None for v in parsed]


class GenerativeJudge:
    """A causal LM judge on the native engine; see the module docstring."""

    def __init__(self, path: str, *, key: str, judge: JudgeConfig, rollout: RewardModelRolloutConfig,
                 device: torch.device, dtype: torch.dtype, seed: int = 0, trust_remote_code: bool = False):
        from polyrl.models.loader import load_causal_lm, load_tokenizer
        from polyrl.rollout.native.engine import NativeEngine

        self.template, parser = load_judge_file(judge, key)
        self.verdicts = Verdicts(parser, judge.default_score)
        self.tokenizer = load_tokenizer(path, key=key, trust_remote_code=trust_remote_code)
        lm = load_causal_lm(path, dtype=dtype, key=key, trust_remote_code=trust_remote_code)
        self.rollout = rollout
        self.engine = NativeEngine.from_hf(
            lm, device=device, dtype=dtype, gpu_memory_utilization=rollout.gpu_memory_utilization,
            max_num_seqs=rollout.max_num_seqs, max_num_batched_tokens=rollout.max_num_batched_tokens,
            max_model_len=rollout.prompt_length + rollout.response_length, seed=seed)
        del lm
        self.sleep = rollout.free_cache_engine
        if self.sleep:
            self.engine.release_memory(offload_weights=True)
        eos = self.tokenizer.eos_token_id
        self.stop_ids = tuple(eos if isinstance(eos, (list, tuple)) else [eos]) if eos is not None else ()

    def prompt_ids(self, question: str, response: str, reference: str) -> list[int]:
        message = fill(self.template, question, response, reference)
        if self.tokenizer.chat_template:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                                      add_generation_prompt=True)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = self.tokenizer(message)["input_ids"]
        return ids[-self.rollout.prompt_length:]  # keep the end: the instructions and the generation prompt

    def parse(self, answer: str) -> float | None:
        return self.verdicts.parse(answer)

    def score(self, chats: list[list[dict]], responses: list[str], references: list) -> tuple[list[float], list[bool]]:
        """A score per response, and whether its verdict failed to parse."""
        from polyrl.rollout import SamplingParams

        r = self.rollout
        prompts = [self.prompt_ids(last_user_turn(c), resp, "" if ref is None else str(ref))
                   for c, resp, ref in zip(chats, responses, references)]
        sampling = SamplingParams(n=1, temperature=r.temperature if r.do_sample else 0.0, top_k=r.top_k,
                                  top_p=r.top_p, max_new_tokens=r.response_length, stop_token_ids=self.stop_ids)
        if self.sleep:
            self.engine.resume()
        try:
            out = self.engine.generate(prompts, sampling)
        finally:
            if self.sleep:
                self.engine.release_memory(offload_weights=True)
        return self.verdicts.read(self.tokenizer.batch_decode(out.token_ids, skip_special_tokens=True))
