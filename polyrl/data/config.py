"""`data.*` config group, with verl's key names and defaults (research/verl.md §3)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class DataConfig:
    train_files: str | list[str] | None = None
    """Parquet file(s) of training prompts in verl's schema (data_source, prompt, ability, reward_model, extra_info)."""
    val_files: str | list[str] | None = None
    """Parquet file(s) with held-out prompts for validation; null skips validation."""
    train_batch_size: int = 1024
    """Prompts per training step (each yields rollout.n responses)."""
    val_batch_size: int | None = None
    """Prompts per validation generation batch; null means the whole validation set at once."""
    gen_batch_size: int | None = None
    """Prompts per generation batch under DAPO dynamic sampling; null means data.train_batch_size."""
    max_prompt_length: int = 512
    """Longest prompt in tokens after the chat template; longer ones follow data.truncation."""
    max_response_length: int = 512
    """Longest generated response in tokens."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a chat list [{role, content}, ...] or a plain string (wrapped as one user turn)."""
    reward_fn_key: str = "data_source"
    """Column whose value picks the rule reward function (e.g. 'openai/gsm8k')."""
    truncation: Literal["error", "left", "right", "middle"] = "error"
    """What to do with a prompt over max_prompt_length: fail, keep its end (left), its start (right), or both ends."""
    filter_overlong_prompts: bool = False
    """Drop prompts over max_prompt_length at load time instead of applying data.truncation."""
    filter_overlong_prompts_workers: int = 1
    """Accepted for verl compatibility; prompts are tokenized in one batched fast-tokenizer call, which is threaded."""
    shuffle: bool = True
    """Shuffle training prompts each epoch (deterministically, from data.seed)."""
    seed: int | None = None
    """Seed of the shuffle order; null means 1, as in verl."""
    return_raw_chat: bool = False
    """The raw chat is always kept with each prompt; with multi_turn.enable, True also keeps each trajectory's
    messages (tool turns included) on the rollout output (polyrl/agents)."""
    dataloader_num_workers: int = 0
    """Accepted for verl compatibility; prompts are tokenized once at load time, so no loader work is left."""
    tokenizer: str | None = None
    """Tokenizer directory to use instead of the model's (actor_rollout_ref.model.path)."""
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    """Extra keyword arguments for tokenizer.apply_chat_template, e.g. {enable_thinking: false}."""
