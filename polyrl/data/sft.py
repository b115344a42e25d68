"""SFT data: parquet prompt/response pairs or multi-turn `messages` -> token ids with a loss mask.

The loss mask is 1 on the assistant turns' tokens, from the first content token through the end-of-turn (EOS)
token, and 0 on everything else (system/user turns, the assistant header, the newline a template adds after EOS).

How the mask is found: the chat template renders each conversation prefix to text; an assistant turn's span is the
text added between "history + assistant header" and "history + this turn". The full conversation is tokenized once
with character offsets, and a token is trained on when its first character falls in a span. Working in characters
rather than re-tokenizing pieces keeps the mask right for BPE tokenizers that merge across turn boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from polyrl.data.dataset import _type, as_file_list, check_chat_template, read_parquet_rows, to_chat
from polyrl.errors import DataError


@dataclass
class SFTSample:
    input_ids: list[int]
    loss_mask: list[int]


def _render(tokenizer, messages: list[dict], generation_prompt: bool, kw: dict) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False, **kw)


def assistant_spans(
    tokenizer, messages: list[dict], where: str, kw: dict | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character spans the loss covers."""
    kw = kw or {}
    full = _render(tokenizer, messages, False, kw)
    eos = tokenizer.eos_token or ""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i == 0:
            raise DataError(f"{where}: the conversation starts with an assistant turn; put a user turn before it.")
        before = _render(tokenizer, messages[:i], True, kw)
        upto = _render(tokenizer, messages[: i + 1], False, kw)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise DataError(
                f"{where}: the chat template does not render conversation prefixes as prefixes of the whole "
                f"(turn {i}), so the assistant tokens cannot be located; use a template without history rewriting."
            )
        start, end = len(before), len(upto)
        cut = upto.rfind(eos, start, end) if eos else -1
        spans.append((start, cut + len(eos) if cut >= 0 else end))  # stop after EOS: nothing follows it at inference
    return full, spans


def encode_with_mask(tokenizer, text: str, spans: list[tuple[int, int]]) -> SFTSample:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(s <= a < e for s, e in spans)) for a, _ in enc["offset_mapping"]]
    return SFTSample(list(enc["input_ids"]), mask)


def load_sft_dataset(
    files: str | list[str],
    tokenizer,
    *,
    prompt_key: str = "prompt",
    response_key: str = "response",
    messages_key: str = "messages",
    max_length: int = 1024,
    truncation: Literal["error", "right"] = "error",
    apply_chat_template_kwargs: dict | None = None,
) -> list[SFTSample]:
    """Tokenized SFT samples: rows with `messages` (multi-turn) or `prompt` (string or chat list) + `response`."""
    check_chat_template(tokenizer)
    out = []
    for path in as_file_list(files):
        rows = read_parquet_rows(path)
        if not rows:
            continue
        cols = list(rows[0])
        if messages_key not in cols and not (prompt_key in cols and response_key in cols):
            raise DataError(
                f"Data file '{path}' has neither a '{messages_key}' column nor '{prompt_key}' + '{response_key}' "
                f"columns (it has: {', '.join(cols)}); set data.messages_key or data.prompt_key/response_key."
            )
        for i, r in enumerate(rows):
            where = f"Row {i} of '{path}'"
            if messages_key in cols:
                messages = to_chat(r[messages_key], where, messages_key)
            else:
                if not isinstance(r[response_key], str):
                    raise DataError(f"{where}: column '{response_key}' must be a string, got {_type(r[response_key])}.")
                reply = {"role": "assistant", "content": r[response_key]}
                messages = to_chat(r[prompt_key], where, prompt_key) + [reply]
            if not any(m["role"] == "assistant" for m in messages):
                raise DataError(f"{where}: the conversation has no assistant turn to train on; add one or drop it.")
            text, spans = assistant_spans(tokenizer, messages, where, apply_chat_template_kwargs)
            sample = encode_with_mask(tokenizer, text, spans)
            if len(sample.input_ids) > max_length:
                if truncation == "error":
                    raise DataError(
                        f"{where} is {len(sample.input_ids)} tokens long, over the max length {max_length}; raise "
                        f"data.max_length or set data.truncation=right."
                    )
                sample = SFTSample(sample.input_ids[:max_length], sample.loss_mask[:max_length])
            out.append(sample)
    if not out:
        names = ", ".join(repr(p) for p in as_file_list(files))
        raise DataError(f"Data file(s) {names} hold no rows; point them at a non-empty dataset.")
    return out

