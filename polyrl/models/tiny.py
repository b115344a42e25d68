"""Tiny models and tokenizers built locally, for the embedded defaults and the tests (no hub access needed).

The character tokenizer covers `string.printable` plus ChatML special tokens, so any ASCII prompt round-trips
exactly and the chat template works like Qwen's. Models are ordinary HF causal LMs (Llama or Qwen2) saved with
`save_pretrained`, so everything downstream uses the real loading path (`from_pretrained(local_dir)`).
"""

from __future__ import annotations

import string
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]


def build_char_tokenizer(chat_template: str | None = CHAT_TEMPLATE, extra_special_tokens: tuple[str, ...] = ()):
    """A character-level fast tokenizer: one token per printable ASCII char, ChatML specials, EOS = <|im_end|>.
    `extra_special_tokens` (e.g. `<tool_call>`) get the ids after the printable characters, so others keep theirs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in string.printable:
        vocab.setdefault(ch, len(vocab))
    for t in extra_special_tokens:
        vocab.setdefault(t, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        bos_token=None,
        unk_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|endoftext|>", *extra_special_tokens],
    )
    tok.padding_side = "left"
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


def tiny_config(vocab_size: int, *, arch="llama", hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate=128,
                max_position_embeddings=512, tie=True, **kw):
    """A tiny Llama (default), Qwen2 or Qwen3-MoE config.

    Llama is the default for saved tiny models because transformers 5 forces `Qwen2Tokenizer` (a byte-level BPE) onto
    any directory whose config says `qwen2`, which would break our character tokenizer on reload (`qwen3_moe` keeps
    it). `qwen3_moe` takes `num_experts` (8), `num_experts_per_tok` (2) and `moe_intermediate_size` (intermediate / 2)
    in `kw`, with Qwen3-30B-A3B's `norm_topk_prob=True`.
    """
    from transformers import LlamaConfig, Qwen2Config, Qwen3MoeConfig

    if arch == "qwen3_moe":
        kw = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": intermediate // 2,
              "norm_topk_prob": True, "head_dim": hidden_size // heads, **kw}
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3_moe": Qwen3MoeConfig}[arch]
    return cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie,
        **kw,
    )


def build_tiny_model(out_dir: str | Path, *, seed: int = 0, extra_special_tokens: tuple[str, ...] = (),
                     **config_kw) -> Path:
    """Build a random tiny causal LM + char tokenizer and save both to `out_dir` (HF format)."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = build_char_tokenizer(extra_special_tokens=tuple(extra_special_tokens))
    cfg = tiny_config(len(tok), **config_kw)
    cfg.pad_token_id = tok.pad_token_id
    cfg.eos_token_id = tok.eos_token_id
    cfg.bos_token_id = None
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
