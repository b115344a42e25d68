"""No raw OOM on one GPU (issue 18): GRPO steps at every (response length, user token budget) pair.

    PYTHONPATH=. python benchmarks/oom_sweep.py --lengths 256,1024 --out $OUT/sweep_short
    PYTHONPATH=. python benchmarks/oom_sweep.py --lengths 4096 --prompts 8 --out $OUT/sweep_4096

Same model, data and reward as grpo_step.py (Qwen2.5-1.5B shape, prompt 128, n=8). Each run is one `PPOTrainer` step
with the user's `actor_rollout_ref.actor.ppo_max_token_len_per_gpu=<budget>` and every other memory key on auto
(training/memory.py), as `polyrl train` with that one key would run. A run passes if it completes (possibly after
retries that shrink the budget, trainer/oom.py) or stops with `OutOfMemoryStop`'s one sentence; any other exception,
a raw `torch.OutOfMemoryError` included, is a CRASH and the script exits 1. Prints one table row per run.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import sys
import time
from contextlib import redirect_stderr
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BUDGETS = "8192,16384,24576,32768,49152,65536"


def one_run(work, model_dir, tok_dir, *, length, prompts, n, budget, device="cuda") -> dict:
    from polyrl.config import build_config
    from polyrl.errors import UserError
    from polyrl.trainer.config import PPOConfig
    from polyrl.trainer.ppo import PPOTrainer

    run = work / f"sweep_{length}_{budget}"
    overrides = [
        "algorithm.adv_estimator=grpo", f"data.train_files={work / 'train.parquet'}",
        f"data.train_batch_size={prompts}", "data.max_prompt_length=128", f"data.max_response_length={length}",
        f"actor_rollout_ref.model.path={model_dir}", f"actor_rollout_ref.model.tokenizer_path={tok_dir}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}", "actor_rollout_ref.actor.use_kl_loss=False",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}", f"actor_rollout_ref.rollout.n={n}",
        "actor_rollout_ref.rollout.ignore_eos=True", f"custom_reward_function.path={work / 'reward.py'}",
        "trainer.logger=[console]", f"trainer.run_dir={run}", f"trainer.default_local_dir={run / 'ckpt'}",
        "trainer.total_training_steps=1", "trainer.save_freq=-1", "trainer.val_before_train=False",
        "trainer.resume_mode=disable", "trainer.progress_bar=False", f"trainer.device={device}",
    ]
    cuda = device == "cuda"
    t0 = time.perf_counter()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    err = io.StringIO()
    row = {"length": length, "budget": budget}
    trainer = None
    try:
        with redirect_stderr(err):
            trainer = PPOTrainer(build_config(PPOConfig(), overrides))
            m = trainer.step()
        a = trainer.cfg.actor_rollout_ref
        row.update(result="completed", retries=trainer.oom.num_retries,
                   final_budget=a.actor.ppo_max_token_len_per_gpu, grad_ckpt=a.model.enable_gradient_checkpointing,
                   tok_s=round(m["perf/throughput"]), step_s=round(m["timing_s/step"], 2))
    except UserError as e:
        row.update(result="stopped", sentence=str(e))
    except Exception as e:  # noqa: BLE001 - anything else is what this sweep exists to catch
        row.update(result="CRASH", error=repr(e)[:300])
    row["warnings"] = [s for s in err.getvalue().splitlines() if "polyrl: warning" in s]
    row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else "-"
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    if trainer is not None:
        trainer.dist.close()
    del trainer
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def main(argv=None):
    from grpo_step import setup

    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="256,1024,4096")
    ap.add_argument("--budgets", default=BUDGETS)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--work", default="/tmp/oom_sweep")
    ap.add_argument("--out", default=None, help="folder for sweep.json")
    ap.add_argument("--shape", default="1.5b", choices=["1.5b", "tiny"], help="tiny + --device cpu: a smoke test")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args(argv)
    torch._dynamo.config.cache_size_limit = 64  # every run compiles its own layers: keep them all compiled
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model_dir, tok_dir, _ = setup(work, init_std=0.01, num_prompts=args.prompts, prompt_tokens=128, shape=args.shape,
                                  device=args.device)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"| device | resp | user budget | result | retries | budget used | grad ckpt | tok/s | peak GiB | note |\n"
          "|---|---|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for length in [int(x) for x in args.lengths.split(",")]:
        for budget in [int(x) for x in args.budgets.split(",")]:
            r = one_run(work, model_dir, tok_dir, length=length, prompts=args.prompts, n=args.n, budget=budget,
                        device=args.device)
            rows.append(r)
            note = r.get("sentence") or r.get("error") or "; ".join(r["warnings"])[:200]
            print(f"| {device} | {length} | {budget} | {r['result']} | {r.get('retries', '-')} | "
                  f"{r.get('final_budget', '-')} | {r.get('grad_ckpt', '-')} | {r.get('tok_s', '-')} | "
                  f"{r['peak_gib']} | {note} |", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "sweep.json").write_text(json.dumps({"device": device, "rows": rows}, indent=1))
    crashed = [r for r in rows if r["result"] == "CRASH"]
    print(f"{len(rows)} runs: {sum(r['result'] == 'completed' for r in rows)} completed, "
          f"{sum(r['result'] == 'stopped' for r in rows)} stopped with one sentence, {len(crashed)} crashed", flush=True)
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
