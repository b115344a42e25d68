"""`polyrl quickstart --task tools`: the embedded tiny model learns to call a calculator, on CPU, with no downloads.

The task is the product of two 3-digit numbers ('123*456=' -> '56088'), which a 2-layer character model cannot
compute. Its warm-up SFT data is noisy in the quickstart's way: 30% of the demonstrations call the calculator
(`<tool_call>{"name":"calc","arguments":{"e":"123*456"}}</tool_call>`, the tool answers, the model copies the
answer), 70% answer directly (correctly: the model still cannot learn to multiply from them). Greedy decoding then
mostly answers directly and is mostly wrong. GRPO with `multi_turn.enable=True` and the calculator (the same keys
a user types: tool YAML, `tool_agent`) rewards the trajectories that called the tool, and held-out accuracy rises.
`--no-tools` runs the control: the same model and recipe with multi-turn off, which stays low.

The format is kept short for the CPU: `<tool_call>`/`</tool_call>` are single tokens of the tiny tokenizer and the tool
is named `calc` with one argument `e`, so a tool-using trajectory samples ~50 tokens.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from polyrl.data.dataset import write_parquet
from polyrl.data.synthetic import make_rows
from polyrl.trainer.quickstart import (QuickstartSettings, _key, cache_root, grpo_overrides,
                                      train_between_validations)

TOOL_TOKENS = ("<tool_call>", "</tool_call>")
TOOL_YAML = """tools:
  - class_name: polyrl.tools.calculator.CalculatorTool
    config: {type: native}
    tool_schema:
      type: function
      function:
        name: calc
        description: Evaluate an arithmetic expression.
        parameters: {type: object, properties: {e: {type: string}}, required: [e]}
"""


@dataclass
class ToolsSettings(QuickstartSettings):
    task: str = "multiply"
    sft_correct_fraction: float = 0.3  # here: the fraction of demonstrations that call the tool
    num_train: int = 1500
    num_val: int = 64
    sft_steps: int = 900  # 600 left the copying of the tool's answer weak under transformers 5.25 (+17 to +34 points)
    sft_batch: int = 32
    grpo_steps: int = 12
    prompts_per_step: int = 16
    n: int = 8
    lr: float = 1e-3
    max_response_length: int = 80


def call_text(a_times_b: str) -> str:
    return f'<tool_call>{{"name":"calc","arguments":{{"e":"{a_times_b}"}}}}</tool_call>'


def build_tools_base_model(s: ToolsSettings) -> Path:
    from polyrl.models.tiny import build_tiny_model

    spec = dict(hidden_size=s.hidden_size, layers=s.layers, heads=s.heads, kv_heads=s.kv_heads,
                intermediate=s.intermediate, seed=s.seed, max_position_embeddings=192, extra=list(TOOL_TOKENS))
    out = cache_root() / "models" / f"tiny-tools-{_key(spec)}"
    if not (out / "config.json").is_file():
        tmp = out.with_name(out.name + f".tmp-{Path.cwd().stat().st_ino}-{time.time_ns()}")
        build_tiny_model(tmp, extra_special_tokens=TOOL_TOKENS, **{k: v for k, v in spec.items() if k != "extra"})
        tmp.replace(out) if not out.exists() else None
    return out


def warm_up(base: Path, rows: list[dict], s: ToolsSettings) -> Path:
    """SFT on the mixed demonstrations (cached by base, data and settings)."""
    from polyrl.data.sft import assistant_spans, encode_with_mask
    from polyrl.models.loader import load_causal_lm, load_tokenizer
    from polyrl.trainer.sft import save_hf_atomic, train_sft

    spec = dict(base=base.name, n=len(rows), steps=s.sft_steps, batch=s.sft_batch, lr=s.sft_lr, seed=s.seed,
                tool=s.sft_correct_fraction, device=s.device)
    out = cache_root() / "models" / f"sft-tools-{_key(spec)}"
    if (out / "config.json").is_file():
        return out
    tok = load_tokenizer(str(base))
    rng = random.Random(s.seed)
    samples = []
    for r in rows:
        q, answer = r["prompt"][0]["content"], r["reward_model"]["ground_truth"]
        if rng.random() < s.sft_correct_fraction:
            msgs = [r["prompt"][0], {"role": "assistant", "content": call_text(q.rstrip("="))},
                    {"role": "tool", "content": answer}, {"role": "assistant", "content": answer}]
        else:
            msgs = [r["prompt"][0], {"role": "assistant", "content": answer}]
        text, spans = assistant_spans(tok, msgs, "quickstart --task tools")
        samples.append(encode_with_mask(tok, text, spans))
    model = load_causal_lm(str(base)).to(s.device)
    torch.manual_seed(s.seed)
    train_sft(model, samples, pad_id=tok.pad_token_id, batch_size=s.sft_batch, micro_batch_size=s.sft_batch,
              lr=s.sft_lr, steps=s.sft_steps, device=torch.device(s.device), warmup_steps=s.sft_steps // 10,
              scheduler="cosine", seed=s.seed, by_length=True)  # tool calls are 3x longer than direct answers
    return save_hf_atomic(model, tok, out)


def tools_overrides(run: Path, s: ToolsSettings, tools: bool) -> list[str]:
    yaml_path = run / "tools.yaml"
    yaml_path.write_text(TOOL_YAML)
    out = [o for o in grpo_overrides(Path("MODEL"), run / "data", run, s)
           if not o.startswith(("data.max_response_length", "trainer.test_freq"))]
    out += [f"data.max_response_length={s.max_response_length}", f"trainer.test_freq={s.grpo_steps}"]
    if tools:
        mt = "actor_rollout_ref.rollout.multi_turn"
        out += [f"{mt}.enable=True", f"{mt}.tool_config_path={yaml_path}", f"{mt}.max_assistant_turns=2",
                f"{mt}.max_tool_response_length=64", "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent"]
    return out


def run_tools_quickstart(run_dir: str | None = None, *, tools: bool = True, settings: ToolsSettings | None = None,
                         extra_overrides: list[str] | None = None) -> dict:
    from polyrl.config import build_config
    from polyrl.trainer.config import PPOConfig

    t0 = time.perf_counter()
    s = settings or ToolsSettings()
    run = Path(run_dir or f"runs/quickstart-tools/{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    (run / "data").mkdir(parents=True, exist_ok=True)
    train_rows = make_rows(s.task, s.num_train, seed=s.seed, split="train")
    write_parquet(train_rows, run / "data" / "train.parquet")
    write_parquet(make_rows(s.task, s.num_val, seed=s.seed, split="val"), run / "data" / "val.parquet")
    sft_dir = warm_up(build_tools_base_model(s), train_rows, s)
    overrides = [o.replace("MODEL", str(sft_dir)) for o in tools_overrides(run, s, tools)] + list(extra_overrides or [])
    cfg = build_config(PPOConfig(), overrides)
    before, after, _ = train_between_validations(cfg, overrides, run)
    key = next(k for k in before if k.startswith("val-core/") and "/acc/mean@" in k)
    result = {"accuracy_before": before[key], "accuracy_after": after[key], "wall_s": time.perf_counter() - t0,
              "run_dir": str(run), "metric": key, "tools": tools}
    (run / "quickstart.json").write_text(json.dumps(result, indent=1))
    return result
