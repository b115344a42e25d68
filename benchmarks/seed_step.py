"""Seed 002's whole GRPO step, printed as its table beside verl's and RLinf's columns (issue 22).

    PYTHONPATH=. torchrun --standalone --nproc_per_node=8 benchmarks/seed_step.py               # the seed's node
    PYTHONPATH=. torchrun --standalone --nproc_per_node=2 benchmarks/seed_step.py --seqs 128   # 2 GPUs, 64 each
    PYTHONPATH=. torchrun --standalone --nproc_per_node=2 benchmarks/seed_step.py --mode offpolicy --seqs 128
    PYTHONPATH=. torchrun --standalone --nproc_per_node=2 benchmarks/seed_step.py --shape tiny --device cpu ...

The seed (verl v0.5.0, 8 H100s, DeepSeek-R1-Distill-Qwen-1.5B, SP 2 x DP 4) trains 512 sequences a step: 64 prompts
x n=8, 1,024-token prompts, responses of mean 14.3k and max 27.6k tokens (context 28,672). Here: the same model shape
with random weights (untied LM head), the same prompt length, and forced response lengths drawn per step from
`seed_workloads.py`'s s1 distribution (normal 14,200 +- 6,500 clipped to [1,500, 27,648], mean 14,200, one row at
the maximum), so the decode tail is the seed's. Everything else is the product's defaults (`--extra` adds keys: FP8
rollout, rollout correction, Ulysses SP, ...), colocated data parallel over the processes, or with `--mode offpolicy`
the one-step off-policy pipeline (2 processes). The first `--warmup` steps are left out.

Printed per timed step and averaged: response length, generation time, prev-logprob time (absent where the update's
own forward supplies the old log-probs: the row says so), training time, step time, generation throughput in both
readings of the seed (per GPU, and per rollout replica of 2 GPUs, which is the seed's "per GPU"), prev-logprob
throughput per GPU, and step throughput for the whole job. `--rows-out` appends one row per run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from offpolicy_step import ForcedLengths, run  # noqa: E402

# seed 002's table (verl v0.5.0 and RLinf, 8 H100s); generation "per GPU" is per rollout replica of 2 GPUs there
SEED = {
    "verl": dict(response_length=14255, gen_s=260.9, old_log_prob_s=17.5, update_actor_s=61.1, step_s=363.5,
                 gen_tok_s_per_replica=6993, old_log_prob_tok_s_per_gpu=52636, step_tok_s_total=20023),
    "RLinf": dict(response_length=13975, gen_s=266.1, old_log_prob_s=17.8, update_actor_s=61.1, step_s=346.3,
                  gen_tok_s_per_replica=6801, old_log_prob_tok_s_per_gpu=50835, step_tok_s_total=20882),
}


class SeedLengths(ForcedLengths):
    """Forced response lengths from seed 002's distribution (a new draw per generate call)."""

    def lengths(self, num: int) -> list[int]:
        rng = np.random.default_rng(self.seed + self.calls)
        self.calls += 1
        sd, low = self.mean_len * 6500 / 14200, max(1, round(self.max_len * 1500 / 27648))  # s1's, to scale
        x = np.clip(rng.normal(self.mean_len, sd, num), low, self.max_len)
        x = np.clip(x * self.mean_len / x.mean(), low, self.max_len).astype(int)
        x[int(np.argmax(x))] = self.max_len
        return x.tolist()


def overrides(args, work: Path) -> list[str]:
    """offpolicy_step.py's keys for this shape (memory keys on auto), no checkpoints."""
    from offpolicy_step import overrides as run_keys

    args.prompts, args.max_age, args.grad_ckpt, args.max_token_len = args.seqs // args.n, 1, "auto", None
    args.gpu_mem_colocated = args.gpu_mem_rollout = None
    keys = run_keys(args, work, work / "model", work / "tokenizer", prompt_len=args.prompt)
    return keys[:len(keys) - len(args.extra)] + ["trainer.save_freq=-1"] + list(args.extra)  # the user's keys last


def table(steps: list[dict], *, gpus: int, rollout_gpus: int, train_gpus: int) -> dict:
    """The seed's metrics for these steps (means), in its units; `rollout_gpus` generate, `train_gpus` train."""
    mean = lambda key: float(np.mean([m.get(key, 0.0) for m in steps]))  # noqa: E731
    # the batch's new tokens, as the seed counts generation (7.30M for 512 x 14.26k): every response token
    new = mean("response_length/mean") * mean("bench/num_seqs")
    total = mean("perf/total_num_tokens")
    gen, old, step = mean("timing_s/gen"), mean("timing_s/old_log_prob"), mean("timing_s/step")
    return dict(response_length=mean("response_length/mean"), gen_s=gen, old_log_prob_s=old or None,
                update_actor_s=mean("timing_s/update_actor"), step_s=step,
                gen_tok_s_per_gpu=new / gen / rollout_gpus, gen_tok_s_per_replica=2 * new / gen / rollout_gpus,
                old_log_prob_tok_s_per_gpu=total / old / train_gpus if old else None,
                step_tok_s_total=total / step, gpus=gpus)


def print_table(ours: dict, label: str) -> None:
    rows = [("response length (tokens)", "response_length", "{:,.0f}"), ("generation time (s)", "gen_s", "{:.1f}"),
            ("prev logprob time (s)", "old_log_prob_s", "{:.1f}"), ("training time (s)", "update_actor_s", "{:.1f}"),
            ("step time (s)", "step_s", "{:.1f}"),
            ("gen throughput, per replica of 2 GPUs (the seed's 'per GPU')", "gen_tok_s_per_replica", "{:,.0f}"),
            ("gen throughput per GPU", "gen_tok_s_per_gpu", "{:,.0f}"),
            ("prev logprob throughput per GPU", "old_log_prob_tok_s_per_gpu", "{:,.0f}"),
            ("step throughput, whole job (tok/s)", "step_tok_s_total", "{:,.0f}")]
    print(f"\n| metric | polyrl ({label}) | verl (seed, 8 H100) | RLinf (seed, 8 H100) |\n|---|---|---|---|")
    for name, key, fmt in rows:
        cell = lambda d: "-" if d.get(key) is None else fmt.format(d[key])  # noqa: E731
        seed_v = {k: {**v, "gen_tok_s_per_gpu": v["gen_tok_s_per_replica"] / 2} for k, v in SEED.items()}
        ours_cell = cell(ours) if key != "old_log_prob_s" or ours[key] else "skipped (old from the update's forward)"
        print(f"| {name} | {ours_cell} | {cell(seed_v['verl'])} | {cell(seed_v['RLinf'])} |")


def main(argv=None) -> None:
    from grpo_step import rollout_name, setup

    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["colocated", "offpolicy"], default="colocated")
    ap.add_argument("--shape", default="r1-1.5b", choices=["r1-1.5b", "tiny"])
    ap.add_argument("--seqs", type=int, default=512, help="sequences per step, whole job (the seed: 512)")
    ap.add_argument("--samples-per-prompt", dest="n", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--mean-len", type=int, default=14200)
    ap.add_argument("--max-len", type=int, default=27648)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1, help="leading steps left out of the averages")
    ap.add_argument("--work", default="/tmp/seed_step")
    ap.add_argument("--rows-out", default=None)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--note", default="", help="words for the row's config column (say which levers are on)")
    ap.add_argument("--extra", nargs="*", default=[], help="polyrl train overrides (FP8, SP, rollout correction ...)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    args = ap.parse_args(argv)
    from polyrl.config import build_config
    from polyrl.trainer.config import PPOConfig

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    work = Path(args.work) / args.shape
    work.mkdir(parents=True, exist_ok=True)
    ready = work / f"ready-{os.environ.get('TORCHELASTIC_RUN_ID', 'single')}"
    if rank == 0:
        setup(work, init_std=0.01, num_prompts=args.seqs // args.n * (args.steps + 2), prompt_tokens=args.prompt,
              shape=args.shape, device=args.device)
        ready.write_text("ok")
    while not ready.exists():
        time.sleep(0.5)
    args.rollout = rollout_name() if args.device == "cuda" else "hf"
    steps = run(args, build_config(PPOConfig(), overrides(args, work)), SeedLengths)
    if steps is None:
        return
    for m in steps:
        m["bench/num_seqs"] = args.seqs
    timed = steps[args.warmup:] or steps
    split = (1, 1) if args.mode == "offpolicy" else (world, world)
    ours = table(timed, gpus=world, rollout_gpus=split[0], train_gpus=split[1])
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    label = f"{world}x {device}, {args.mode}"
    print_table(ours, label)
    print("SUMMARY " + json.dumps(ours), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"summary": ours, "steps": steps}, indent=1, default=str))
    if args.rows_out:
        from _record import append_row

        old = f"{ours['old_log_prob_s']:.1f} s" if ours["old_log_prob_s"] else "skipped (old from the update's forward)"
        keys = " ".join(args.extra) or "defaults"
        note = f"; {args.note}" if args.note else ""
        model = "R1-Distill-Qwen-1.5B shape" if args.shape == "r1-1.5b" else "tiny 2-layer model"
        shape = (f"seed 002 whole GRPO step, {model} random init, {args.seqs} seqs "
                 f"({args.seqs // args.n}x{args.n}), prompt {args.prompt}, forced resp mean "
                 f"{ours['response_length']:,.0f} max {args.max_len}; {args.mode} on {world} GPUs; {keys}{note}; "
                 f"gen {ours['gen_s']:.1f} s ({ours['gen_tok_s_per_gpu']:,.0f} tok/s/GPU, "
                 f"{ours['gen_tok_s_per_replica']:,.0f} per 2-GPU replica), prev logprob {old}, train "
                 f"{ours['update_actor_s']:.1f} s, step {ours['step_s']:.1f} s; {len(timed)} timed step(s)")
        append_row(f"{world}x {device}", "seed_step.py step throughput (issue 22)", shape,
                   f"{ours['step_tok_s_total']:,.0f} tok/s total ({ours['step_tok_s_total'] / world:,.0f}/GPU)",
                   peer="verl 20,023 / RLinf 20,882 tok/s total on 8 H100s (2,503 / 2,610 per GPU)",
                   ratio_peer=f"{ours['step_tok_s_total'] / world / (20023 / 8):.2f}x verl per GPU",
                   path=args.rows_out)


if __name__ == "__main__":
    main()
