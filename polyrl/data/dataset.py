"""RL prompt data: verl-schema parquet -> tokenized prompts, and a resumable prompt sampler.

Schema (one row per prompt, as verl's `RLHFDataset` reads it):
  data_source    str                 picks the rule reward (`data.reward_fn_key` names this column)
  prompt         chat list | str     `data.prompt_key`; a plain string is accepted and wrapped as one user turn,
                                     because hand-written parquet files often hold bare strings
  reward_model   {"style", "ground_truth"}
  ability        str                 optional, informational
  extra_info     dict                optional, passed to the reward function

The chat template is applied once at load time (`add_generation_prompt=True`) so the trainer only moves token ids.
Order of operations on a prompt over `max_prompt_length`: `filter_overlong_prompts` drops it first; otherwise
`truncation` applies (error / keep the end / keep the start / keep both ends), as in verl.

`RLSample.index` is the row's position in the concatenated input files (stable across runs, used as the sample id);
the row's own `extra_info.index`, if any, stays in `extra_info`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from polyrl.data.config import DataConfig
from polyrl.errors import DataError


@dataclass
class RLSample:
    prompt_ids: list[int]
    raw_prompt: list[dict]
    data_source: str
    ground_truth: Any
    extra_info: dict = field(default_factory=dict)
    ability: str | None = None
    index: int = 0
    agent_name: str | None = None  # the agent loop that runs this row (polyrl/agents); None: the default loop


# --------------------------------------------------------------------------------------------------- reading files


def as_file_list(files: str | list[str] | tuple | None) -> list[str]:
    if files is None or (isinstance(files, (list, tuple)) and not files):
        raise DataError("No data files were given; set data.train_files (and data.val_files) to parquet paths.")
    return [str(f) for f in ([files] if isinstance(files, (str, Path)) else files)]


def read_parquet_rows(path: str) -> list[dict]:
    """All rows of one parquet file as Python dicts (nested structs become dicts, lists stay lists)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"Data file '{path}' does not exist; check the path in data.train_files / data.val_files.")
    if p.is_dir():
        raise DataError(
            f"Data path '{path}' is a directory; pass the parquet file(s) inside it, e.g. '{p / 'train.parquet'}'."
        )
    try:
        return pq.read_table(p).to_pylist()
    except (pa.ArrowException, OSError) as e:
        is_json = p.suffix in (".json", ".jsonl")
        hint = " (it looks like JSON; convert it, e.g. with `polyrl data gsm8k`)" if is_json else ""
        raise DataError(
            f"Data file '{path}' is not a readable parquet file{hint} ({type(e).__name__}: {e}); "
            f"regenerate or replace it."
        ) from e


def write_parquet(rows: list[dict], path: str | Path) -> Path:
    """Write verl-schema rows (nested dicts/lists become parquet structs/lists) to `path`, creating its folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = Path(path).expanduser()
    p.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), p)
    return p


def _require_columns(path: str, rows: list[dict], needed: dict[str, str]) -> None:
    present = list(rows[0].keys()) if rows else []
    for col, fix in needed.items():
        if rows and col not in rows[0]:
            raise DataError(f"Data file '{path}' has no '{col}' column (it has: {', '.join(present)}); {fix}.")


def _type(v: Any) -> str:
    return f"{type(v).__name__} {v!r}"[:80]


def to_chat(value: Any, where: str, key: str) -> list[dict]:
    """A prompt value as a chat list; plain strings become one user turn."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, (list, tuple)) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    ):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise DataError(
        f"{where}: column '{key}' must be a chat list like [{{'role': 'user', 'content': '...'}}] or a string, "
        f"got {_type(value)}; fix the data or set data.prompt_key to the right column."
    )


def check_chat_template(tokenizer) -> None:
    if getattr(tokenizer, "chat_template", None):
        return
    name = getattr(tokenizer, "name_or_path", "") or "<in-memory tokenizer>"
    raise DataError(
        f"The tokenizer from '{name}' has no chat template; add one (a chat_template.jinja file or 'chat_template' in "
        f"tokenizer_config.json) or set data.tokenizer to a tokenizer directory that has one."
    )


def render_prompts(tokenizer, chats: list[list[dict]], template_kwargs: dict | None = None) -> list[list[int]]:
    """Apply the chat template with the generation prompt, then tokenize all prompts in one batched call."""
    kw = dict(template_kwargs or {})
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False, **kw) for c in chats]
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def truncate(ids: list[int], limit: int, mode: str) -> list[int]:
    if len(ids) <= limit:
        return ids
    if mode == "left":  # keep the end: the question and the generation prompt sit there
        return ids[-limit:]
    if mode == "right":
        return ids[:limit]
    if mode == "middle":
        head = limit // 2
        return ids[:head] + ids[len(ids) - (limit - head):]
    raise ValueError(f"truncation mode {mode!r} is not one of error/left/right/middle")


# --------------------------------------------------------------------------------------------------- the dataset


def load_rl_dataset(files: str | list[str], tokenizer, cfg: DataConfig) -> list[RLSample]:
    """Read verl-schema parquet file(s) into tokenized prompts, honouring the length, filter and truncation keys."""
    check_chat_template(tokenizer)
    paths = as_file_list(files)
    pk, dk = cfg.prompt_key, cfg.reward_fn_key
    needed = {
        pk: "set data.prompt_key to the column holding the prompts",
        dk: "set data.reward_fn_key to the column naming each row's data source",
        "reward_model": "add a 'reward_model' column holding {'style': 'rule', 'ground_truth': ...} per row",
    }
    rows, where = [], []
    for path in paths:
        file_rows = read_parquet_rows(path)
        _require_columns(path, file_rows, needed)
        rows.extend(file_rows)
        where.extend(f"Row {i} of '{path}'" for i in range(len(file_rows)))
    if not rows:
        names = ", ".join(repr(p) for p in paths)
        raise DataError(f"Data file(s) {names} hold no rows; point the data files at a non-empty dataset.")

    chats = [to_chat(r[pk], w, pk) for r, w in zip(rows, where)]
    for r, w in zip(rows, where):
        _check_row_types(r, w, dk)
    ids_all = render_prompts(tokenizer, chats, cfg.apply_chat_template_kwargs)

    samples, limit = [], cfg.max_prompt_length
    for i, (r, w, chat, ids) in enumerate(zip(rows, where, chats, ids_all)):
        if len(ids) > limit:
            if cfg.filter_overlong_prompts:
                continue
            if cfg.truncation == "error":
                raise DataError(
                    f"{w} has a prompt of {len(ids)} tokens, over data.max_prompt_length={limit}; raise "
                    f"data.max_prompt_length, or set data.filter_overlong_prompts=True (drop such rows) or "
                    f"data.truncation=left (cut them)."
                )
            ids = truncate(ids, limit, cfg.truncation)
        samples.append(
            RLSample(
                prompt_ids=ids,
                raw_prompt=chat,
                data_source=r[dk],
                ground_truth=r["reward_model"].get("ground_truth"),
                extra_info=dict(r.get("extra_info") or {}),
                ability=r.get("ability"),
                index=i,
                agent_name=r.get("agent_name"),
            )
        )
    if not samples:
        raise DataError(
            f"All {len(rows)} prompts in {', '.join(repr(p) for p in paths)} are longer than "
            f"data.max_prompt_length={limit} "
            f"and were filtered out; raise data.max_prompt_length."
        )
    return samples


def _check_row_types(r: dict, where: str, dk: str) -> None:
    if not isinstance(r[dk], str) or not r[dk]:
        raise DataError(f"{where}: column '{dk}' must be a non-empty string naming the reward, got {_type(r[dk])}.")
    rm = r["reward_model"]
    if not isinstance(rm, dict) or "ground_truth" not in rm:
        raise DataError(
            f"{where}: column 'reward_model' must be a dict like {{'style': 'rule', 'ground_truth': '72'}}, "
            f"got {_type(rm)}."
        )
    if r.get("extra_info") is not None and not isinstance(r["extra_info"], dict):
        raise DataError(f"{where}: column 'extra_info' must be a dict or null, got {_type(r['extra_info'])}.")
    if r.get("ability") is not None and not isinstance(r["ability"], str):
        raise DataError(f"{where}: column 'ability' must be a string, got {_type(r['ability'])}.")


# --------------------------------------------------------------------------------------------------- the sampler


class PromptSampler:
    """Batches of prompts, epoch after epoch, in an order fixed by (seed, epoch).

    Each epoch's permutation is drawn from a generator seeded with (seed, epoch), so the position is fully described
    by (epoch, offset): restoring them resumes the exact sequence of batches, with no RNG state to pickle. The last
    partial batch of an epoch is dropped (verl's `drop_last=True`), so every step sees `batch_size` prompts.
    """

    def __init__(self, samples: list, batch_size: int, shuffle: bool = True, seed: int | None = None):
        if batch_size < 1 or batch_size > len(samples):
            raise DataError(
                f"The dataset has {len(samples)} prompts but the batch size is {batch_size}; set data.train_batch_size "
                f"between 1 and {len(samples)}, or add data."
            )
        self.samples, self.batch_size, self.shuffle = samples, batch_size, shuffle
        self.seed = 1 if seed is None else seed
        self.epoch, self.offset = 0, 0

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self.samples) // self.batch_size

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.samples))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.samples))

    def __iter__(self):
        """The remaining batches of the current epoch; the position advances as each batch is handed out."""
        epoch, order = self.epoch, self.order(self.epoch)
        for b in range(self.offset, len(self)):
            batch = [self.samples[i] for i in order[b * self.batch_size : (b + 1) * self.batch_size]]
            self.epoch, self.offset = (epoch + 1, 0) if b + 1 == len(self) else (epoch, b + 1)
            yield batch

    def next_batch(self) -> list:
        """One batch, rolling over into the next epoch when this one is used up (for step-counted training)."""
        return next(iter(self))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "shuffle": self.shuffle,
                "num_samples": len(self.samples), "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("seed", "shuffle", "num_samples", "batch_size"):
            if state[key] != mine[key]:
                raise DataError(
                    f"The checkpoint's data position was saved with {key}={state[key]!r} but this run has "
                    f"{key}={mine[key]!r}; resume with the same data and data.* settings, or start a new run "
                    f"(trainer.resume_mode=disable)."
                )
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
