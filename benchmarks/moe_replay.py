"""MoE routing replay on a trained-like tiny Qwen3-MoE, on CPU (issue 47): no replay, R2 and R3 against a real
rollout/trainer difference, each measured as routing agreement and mismatch KL.

    PYTHONPATH=. python benchmarks/moe_replay.py [--steps 3] [--sources bf16,fp8,fp32] [--rows-out FILE | --no-record]

The model: `polyrl quickstart --arch qwen3_moe`'s (8 experts, 2 a token, 2 layers of width 128) after its SFT
warm-up, 300 steps on the reverse task, which trains the routers with everything else. A random router spreads a token
almost evenly over the experts, so the slightest rounding flips its top-k; a trained one is confident, and flips only
where the rounding beats its margin. The script prints both routers' margins (the gap between the k-th and the
(k+1)-th expert's probability), so the reader sees how trained-like the model is.

The rollout/trainer difference is one production has: the trainer's forward is HF's, in fp32 (the CPU trainer's
dtype), and the native engine samples in
- `bf16`: the engine's weights, activations and KV cache in bf16 (what a GPU rollout runs; on CPU the trainer builds
  the engine in fp32, so this script builds it in bf16 itself, everything else as `polyrl train` would);
- `fp8`: `rollout.quantization=fp8` and `rollout.kv_cache_dtype=fp8`, e4m3 weights (attention, experts) and KV,
  emulated on CPU with the CUDA kernels' rounding and scales (the format's numbers, not the kernels');
- `fp32`: the engine's own kernels in fp32 against HF's forward (the control: rounding order only).
Routers stay in the engine's dtype in all three; their inputs carry the difference.

Each (source, mode) runs GRPO steps through `PPOTrainer` with the quickstart's keys, two mini-batches a step (so
old log-probs are recomputed and R2 has a pass to replay), from the same SFT'd weights and seed. The engine records
its routes in every mode (a measurement tap; without R3 the trainer never sees them). Per step, on the batch's
rollout:
- **agreement (used)**: the share of recorded (token, layer) pairs where the experts the trainer's pi_old forward ran
  equal the rollout's. No replay and R2: the trainer's router picks them (R2 then replays them in the update); R3:
  the rollout's own, by construction 1.
- **agreement (router)**: the same with the trainer router's own top-k, unreplayed (how often it would agree).
- **rollout_corr/kl**: the mismatch KL E[log p_rollout - log p_train] over response tokens (verl's k1, the metric
  the trainer logs), and k3 (E[r - 1 - log r], r = p_train / p_rollout: nonnegative, lower variance).
Step 1 is a paired comparison (every mode: the same rollout from the same weights); the runs train apart after it.
Cost: about 18 minutes on 2 busy CPU cores for the 9 runs of 3 steps, plus the SFT warm-up the first time (cached
under POLYRL_CACHE, shared with `polyrl quickstart --arch qwen3_moe`).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SOURCES = {"bf16": dict(dtype=torch.bfloat16), "fp8": dict(quantization="fp8", kv_cache_dtype="fp8"),
           "fp32": {}}
MODES = {"disabled": [], "R2": ["actor_rollout_ref.actor.router_replay.mode=R2"],
         "R3": ["actor_rollout_ref.actor.router_replay.mode=R3",
                "actor_rollout_ref.rollout.enable_rollout_routing_replay=True"]}


def router_margins(model_dir: Path, prompts: list[list[int]]) -> dict[str, float]:
    """Over every (token, layer) of `prompts` in the HF forward: the mean probability of the top-1 expert, the
    median gap p_k - p_(k+1) (k: experts a token uses), the share of pairs whose gap is under 0.01, and the median
    gap between the k-th and (k+1)-th router logits (what a perturbation of the logits must beat to flip a route)."""
    from polyrl.models.loader import load_causal_lm
    from polyrl.models.moe import find_routers

    model = load_causal_lm(str(model_dir)).eval()
    routers = find_routers(model)
    k = routers[0].top_k
    logits = []
    hooks = [r.register_forward_hook(lambda mod, args, out: logits.append(out[0].detach())) for r in routers]
    with torch.no_grad():
        for ids in prompts:
            model(input_ids=torch.tensor([ids]))
    for h in hooks:
        h.remove()
    logits = torch.cat(logits).float().sort(-1, descending=True).values
    probs = logits.softmax(-1)
    gap = probs[:, k - 1] - probs[:, k]
    return {"top1": float(probs[:, 0].mean()), "gap_median": float(gap.median()),
            "gap_under_0.01": float((gap < 0.01).float().mean()),
            "logit_gap_median": float((logits[:, k - 1] - logits[:, k]).median())}


def make_trainer(cfg, source: str, mode: str):
    """`PPOTrainer` with the measurement tap (module docstring) and, for `bf16`, a bf16 engine."""
    from polyrl.learner.actor import compute_logprobs
    from polyrl.rollout.native import NativeEngine
    from polyrl.trainer.ppo import PPOTrainer

    class Tapped(PPOTrainer):
        def _make_engine(self):  # the engine records routes in every mode; bf16 where asked
            r, c = self.cfg.actor_rollout_ref.rollout, self.cfg.data
            return NativeEngine.from_hf(self.model, device=self.device, dtype=SOURCES[source].get("dtype"),
                                        max_num_seqs=r.n * c.train_batch_size,
                                        max_model_len=c.max_prompt_length + c.max_response_length,
                                        seed=r.seed, kv_cache_dtype=r.kv_cache_dtype, quantization=r.quantization,
                                        record_routes=True)

        def _sampling_params(self):
            import dataclasses

            return dataclasses.replace(super()._sampling_params(), record_routes=True)

        def _assemble_batch(self, parts, want, metrics):
            samples, batch, index, metrics = super()._assemble_batch(parts, want, metrics)
            self.rollout_routes = batch["routed_experts"] if mode == "R3" else batch.pop("routed_experts")
            return samples, batch, index, metrics

        def _old_logprobs(self, model, batch, s):
            old = super()._old_logprobs(model, batch, s)
            plain = {k: v for k, v in batch.items() if k != "routed_experts"}
            _, own = compute_logprobs(model, plain, temperature=s.temperature, micro_batch_size=s.micro_batch_size,
                                      fwd=self.actor.fwd, record_routes=True)
            rollout = self.rollout_routes
            have = (rollout[..., 0] >= 0) & (own[..., 0] >= 0)
            same = (rollout.sort(-1).values == own.sort(-1).values).all(-1)
            used = batch.get("routed_experts") if mode == "R2" else (rollout if mode == "R3" else own)
            same_used = (rollout.sort(-1).values == used.sort(-1).values).all(-1)
            mask = batch["response_mask"].bool()
            log_r = (old - batch["rollout_log_probs"])[mask]
            self.tap = {"agree_router": float(same[have].float().mean()),
                        "agree_used": float(same_used[have].float().mean()),
                        "k3": float((log_r.exp() - 1 - log_r).mean())}
            return old

    return Tapped(cfg)


def run(model_dir: Path, data_dir: Path, source: str, mode: str, steps: int, s) -> dict[str, float]:
    from polyrl.config import build_config
    from polyrl.trainer.config import PPOConfig
    from polyrl.trainer.quickstart import grpo_overrides

    run_dir = Path(tempfile.mkdtemp(prefix=f"moe-replay-{source}-{mode}-"))
    extra = {k: v for k, v in SOURCES[source].items() if k != "dtype"}
    overrides = grpo_overrides(model_dir, data_dir, run_dir, s) + MODES[mode] + [
        f"actor_rollout_ref.actor.ppo_mini_batch_size={s.prompts_per_step // 2}",  # two: pi_old is recomputed
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={s.prompts_per_step // 2 * s.n}",
        *(f"actor_rollout_ref.rollout.{k}={v}" for k, v in extra.items())]
    trainer = make_trainer(build_config(PPOConfig(), overrides), source, mode)
    rows = []
    for _ in range(steps):
        m = trainer.step()
        rows.append({**trainer.tap, "kl": m["rollout_corr/kl"], "score": m["critic/score/mean"]})
        print(f"  [{source} {mode}] step {len(rows)}: " + ", ".join(f"{k} {v:.4g}" for k, v in rows[-1].items()),
              flush=True)
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
    return {**mean, **{f"first_{k}": v for k, v in rows[0].items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3, help="GRPO steps per (source, mode)")
    p.add_argument("--sources", default=",".join(SOURCES))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--sft-steps", type=int, default=None, help="SFT warm-up steps (default: the quickstart's 300)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--no-record", action="store_true", help="print only; append no rows to the history")
    p.add_argument("--rows-out", default=None, help="append the rows to this JSON-lines file instead of the history "
                   "(then: python scripts/gen_benchmarks.py add FILE)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from polyrl.data.dataset import write_parquet
    from polyrl.data.synthetic import make_rows
    from polyrl.models.loader import load_tokenizer
    from polyrl.trainer.quickstart import QuickstartSettings, build_base_model, warm_up_with_sft

    s = QuickstartSettings(arch="qwen3_moe")
    if args.sft_steps is not None:
        s.sft_steps = args.sft_steps
    data_dir = Path(tempfile.mkdtemp(prefix="moe-replay-data-"))
    train_rows = make_rows(s.task, s.num_train, seed=s.seed, split="train")
    write_parquet(train_rows, data_dir / "train.parquet")
    write_parquet(make_rows(s.task, s.num_val, seed=s.seed, split="val"), data_dir / "val.parquet")
    base = build_base_model(s)  # cached as the quickstart caches them (POLYRL_CACHE)
    sft = warm_up_with_sft(base, train_rows, s)
    tok = load_tokenizer(str(base))
    probe = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
             for r in train_rows[:64]]
    probe = [list(x["input_ids"]) if isinstance(x, dict) else list(x) for x in probe]
    margins = {name: router_margins(d, probe) for name, d in (("random init", base), ("SFT'd", sft))}
    device = f"CPU {platform.processor() or platform.machine()} x{args.threads} threads ({os.cpu_count()} cores)"
    date = datetime.date.today().isoformat()
    print(f"device: {device}; date: {date}")
    print(f"model: tiny qwen3_moe (8 experts, top-2, 2 layers, hidden 128), the MoE quickstart's after its SFT "
          f"warm-up ({s.sft_steps} steps); trainer forward HF fp32")
    for name, m in margins.items():
        print(f"  router, {name}: top-1 prob {m['top1']:.3f}, median p2 - p3 {m['gap_median']:.3f}, "
              f"(token, layer) pairs with p2 - p3 < 0.01: {m['gap_under_0.01']:.1%}, median logit gap "
              f"{m['logit_gap_median']:.3f}")
    results = {}
    for source in args.sources.split(","):
        for mode in args.modes.split(","):
            results[source, mode] = r = run(sft, data_dir, source, mode, args.steps, s)
            print(f"[{source} {mode}] " + ", ".join(f"{k} {v:.4g}" for k, v in r.items()), flush=True)
    print(f"\nGRPO, {s.prompts_per_step} prompts x {s.n} samples, {args.steps} steps each. Step 1: every mode sees the "
          "same rollout from the same weights (a paired comparison); mean: over the steps (runs diverge after step 1)")
    print("| rollout | replay | agreement (experts used) | agreement (trainer's router) | rollout_corr/kl step 1 | "
          "k3 KL step 1 | rollout_corr/kl mean | k3 KL mean |")
    print("|---|---|---|---|---|---|---|---|")
    for (source, mode), r in results.items():
        print(f"| {source} | {mode} | {r['agree_used']:.4f} | {r['agree_router']:.4f} | {r['first_kl']:.2e} | "
              f"{r['first_k3']:.2e} | {r['kl']:.2e} | {r['k3']:.2e} |")
    if not args.no_record:  # one row per rollout source: its modes side by side
        from _record import append_row

        sft_m = margins["SFT'd"]
        for source in dict.fromkeys(src for src, _ in results):
            by_mode = {mode: r for (src, mode), r in results.items() if src == source}
            cells = ", ".join(f"{'none' if mode == 'disabled' else mode} {r['agree_used']:.4f} / {r['first_kl']:.1e}"
                              for mode, r in by_mode.items())
            router = ", ".join(f"{m} {r['agree_router']:.4f}" for m, r in by_mode.items())
            k3 = ", ".join(f"{m} {r['first_k3']:.1e}" for m, r in by_mode.items())
            kl_mean = ", ".join(f"{m} {r['kl']:.1e}" for m, r in by_mode.items())
            print("appended:", append_row(
                device, f"moe_replay.py {source} rollout",
                f"tiny qwen3_moe (the MoE quickstart's, SFT'd {s.sft_steps} steps: router top-1 {sft_m['top1']:.2f}, "
                f"median p2-p3 {sft_m['gap_median']:.3f}); rollout: native engine {source}, trainer HF fp32; GRPO "
                f"{s.prompts_per_step}x{s.n}, 2 mini-batches, {args.steps} steps; agreement = share of (token, layer) "
                f"expert sets the trainer's pi_old forward used equal to the rollout's, mean over the steps (router's "
                f"own: {router}); KL = rollout_corr/kl at step 1 (same rollout and weights in every mode; k3: {k3}; "
                f"means over the steps, KL: {kl_mean})",
                f"agreement / KL: {cells}", limit="agreement 1, KL 0", path=args.rows_out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
