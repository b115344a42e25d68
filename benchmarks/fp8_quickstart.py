"""Learning with FP8 rollouts: `polyrl quickstart --scale gpu` in bf16 and in FP8 KV + FP8 weights + rollout
correction, several seeds each (#16: the same final held-out accuracy within 3 points).

    PYTHONPATH=. python benchmarks/fp8_quickstart.py --seeds 1,2,3 --rows-out history

The FP8 run quantises every decode GEMM (`engine_kwargs.native.fp8_min_elements=0`): the quickstart's GPU model is
small enough that the default size rule would leave all its GEMMs in bf16, and the point is to test learning under
FP8 weights. Rollout correction: token-level truncated importance weights (TIS, threshold 2). The seed varies the
GRPO run (`trainer.seed`); the SFT warm-up is the same cached model for all runs. Reported per run: final held-out
greedy accuracy and the mean over steps of training/rollout_probs_diff_mean and rollout_corr/kl.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _record import append_row  # noqa: E402

FP8 = ["actor_rollout_ref.rollout.kv_cache_dtype=fp8", "actor_rollout_ref.rollout.quantization=fp8",
       "+actor_rollout_ref.rollout.engine_kwargs.native.fp8_min_elements=0",
       "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0"]
# the recipe engine_kwargs.native.fp8_lm_head=True on top: the LM head in FP8 too (tied here: an e4m3 copy of the
# embedding), so the sampled tokens' log-probs come from e4m3 logits
CONFIGS = {"bf16": [], "fp8kv_w8_tis": FP8,
           "fp8kv_w8head_tis": FP8 + ["+actor_rollout_ref.rollout.engine_kwargs.native.fp8_lm_head=True"]}


def metric_mean(run_dir: str, key: str) -> float | None:
    vals = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            v = json.loads(line).get(key)
            if v is not None:
                vals.append(v)
    return float(np.mean(vals)) if vals else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--configs", default="bf16,fp8kv_w8_tis")
    ap.add_argument("--rows-out", default=None)
    args = ap.parse_args()
    from polyrl.trainer.quickstart import GPU_SCALE, QuickstartSettings, run_quickstart

    dev = torch.cuda.get_device_name()
    results = {}
    for cname in args.configs.split(","):
        for seed in args.seeds.split(","):
            run = tempfile.mkdtemp(prefix=f"qs-{cname}-{seed}-")
            r = run_quickstart(run, extra_overrides=[f"trainer.seed={seed}", "trainer.logger=[file]"] + CONFIGS[cname],
                               settings=QuickstartSettings(**GPU_SCALE))
            r["probs_diff"] = metric_mean(r["run_dir"], "training/rollout_probs_diff_mean")
            r["corr_kl"] = metric_mean(r["run_dir"], "rollout_corr/kl")
            results.setdefault(cname, []).append(r)
            print(f"[{cname} seed {seed}] accuracy {100 * r['accuracy_before']:.1f}% -> {100 * r['accuracy_after']:.1f}% "
                  f"in {r['wall_s']:.0f} s; rollout_probs_diff_mean {r['probs_diff']}; rollout_corr/kl {r['corr_kl']}",
                  flush=True)
    print("\n| config | final accuracy per seed | mean | rollout_probs_diff_mean | rollout_corr/kl |")
    print("|---|---|---|---|---|")
    for cname, rs in results.items():
        accs = [100 * r["accuracy_after"] for r in rs]
        pd = [r["probs_diff"] for r in rs if r["probs_diff"] is not None]
        kl = [r["corr_kl"] for r in rs if r["corr_kl"] is not None]
        pd_s = f"{np.mean(pd):.2e}" if pd else "-"
        kl_s = f"{np.mean(kl):.2e}" if kl else "-"
        print(f"| {cname} | {', '.join(f'{a:.1f}' for a in accs)} | {np.mean(accs):.1f} | {pd_s} | {kl_s} |")
        if args.rows_out:
            append_row(dev, "fp8_quickstart.py", f"quickstart --scale gpu, {cname}, seeds {args.seeds}; "
                       f"rollout_probs_diff_mean {pd_s}, rollout_corr/kl {kl_s}",
                       f"final held-out acc {np.mean(accs):.1f}% ({', '.join(f'{a:.1f}' for a in accs)})",
                       path=args.rows_out)


if __name__ == "__main__":
    main()
