"""One-step off-policy vs on-policy colocated: the whole GRPO step on N GPUs, in tokens/s/GPU (issues 17, 48).

    PYTHONPATH=. torchrun --standalone --nproc_per_node=2 benchmarks/offpolicy_step.py --mode colocated
    PYTHONPATH=. torchrun --standalone --nproc_per_node=2 benchmarks/offpolicy_step.py --mode offpolicy
    PYTHONPATH=. torchrun --standalone --nproc_per_node=4 benchmarks/offpolicy_step.py --mode colocated
    PYTHONPATH=. torchrun --standalone --nproc_per_node=4 benchmarks/offpolicy_step.py --mode offpolicy --trainers 2
    PYTHONPATH=. torchrun --standalone --nproc_per_node=4 benchmarks/offpolicy_step.py --mode offpolicy --trainers 2 \
        --rollout-tp 2
    (add --shape 7b for the Qwen2.5-7B shape; --rows-out history appends a row; --shape tiny --device cpu is
    a smoke test of the same path over gloo)

Off-policy placement (trainer/rollout_pool.py): `--trainers T` processes train (FSDP2 over them; default 1), the
other `nproc_per_node - T` generate, as data-parallel replicas of `--rollout-tp` processes each (default 1).

With `--extra async_training.partial_rollout=True` a row decoded past the cap keeps its drawn length in the next call.
Both modes train the same global batch (`--prompts` x n=8, prompt 128 tokens) from the same random-init checkpoint
(grpo_step.py's setup: Qwen2.5 shape, char tokenizer, digit-fraction reward). Response lengths are forced from a
long-tailed lognormal like NeMo RL's (mean ~`--mean-len`, clipped to [16, `--max-len`], a new draw per batch), so
the decode tail is what it would be in a real run while the random weights never stop early.
- colocated: today's trainer, data-parallel over both GPUs (FSDP2; each GPU generates and trains half the batch).
- offpolicy: `actor_rollout_ref.hybrid_engine=False`: the rollout GPUs generate batch k+1 while the trainer GPUs
  train on batch k; weights stream trainer -> rollout over NCCL after each update, a decoder layer at a time, each
  TP rank receiving only its slice.
Throughput = (prompt + response tokens of the step's batch) / (step wall time x all GPUs), averaged over the steps after
the first `--warmup` (the off-policy pipeline's first step cannot overlap: nothing was generated ahead yet). The
script prints each step's stages, the exposed generation time and the rollout's idle time, then one summary line.
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


class ForcedLengths:
    """Wraps an engine: every generate call draws per-sample forced lengths from the long-tailed distribution."""

    def __init__(self, engine, mean_len: int, max_len: int, seed: int):
        self.inner, self.mean_len, self.max_len, self.calls, self.seed = engine, mean_len, max_len, 0, seed
        self.left: dict[tuple, int] = {}  # partial rollouts: a continued row's prompt + tokens -> its length left

    def lengths(self, num: int) -> list[int]:
        sigma = 0.9  # lognormal mean = exp(mu + sigma^2 / 2)
        rng = np.random.default_rng(self.seed + self.calls)
        self.calls += 1
        x = rng.lognormal(np.log(self.mean_len) - sigma ** 2 / 2, sigma, num)
        return np.clip(x, 16, self.max_len).astype(int).tolist()

    def generate(self, prompt_ids, sampling):
        import dataclasses

        caps = sampling.max_new_tokens_per_row
        if caps is None:
            forced = self.lengths(len(prompt_ids) * sampling.n)
            return self.inner.generate(prompt_ids, dataclasses.replace(
                sampling, forced_lengths=forced, ignore_eos=True, max_new_tokens=self.max_len))
        # partial rollouts (n=1, a cap per row): a continued row keeps the length drawn when it started
        fresh = iter(self.lengths(len(prompt_ids)))
        total = [self.left.pop(tuple(p), None) or next(fresh) for p in prompt_ids]
        forced = [max(1, min(t, c)) for t, c in zip(total, caps)]
        # the caps stay: a row shorter than its cap ends as at EOS and frees its cache; one at its cap keeps it
        out = self.inner.generate(prompt_ids, dataclasses.replace(sampling, forced_lengths=forced, ignore_eos=True))
        for p, toks, t in zip(prompt_ids, out.token_ids, total):
            if t > len(toks):
                self.left[tuple(p) + tuple(toks)] = t - len(toks)
        return out

    def __getattr__(self, name):  # update_weights, release_memory, resume, num_calls, model ...
        return getattr(self.inner, name)


def hand_keys(args) -> list[str]:
    """The memory keys set by hand on the command line (none: the product's auto defaults)."""
    mem = args.gpu_mem_rollout if args.mode == "offpolicy" else args.gpu_mem_colocated
    hand = [f"actor_rollout_ref.rollout.gpu_memory_utilization={mem}"] if mem else []
    if args.grad_ckpt != "auto":
        hand.append(f"actor_rollout_ref.model.enable_gradient_checkpointing={args.grad_ckpt == 'on'}")
    if args.max_token_len:
        hand += [f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={args.max_token_len}",
                 f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={args.max_token_len}"]
    return hand


def overrides(args, work: Path, model_dir: Path, tok_dir: Path, prompt_len: int = 128) -> list[str]:
    """The `polyrl train` keys of a run: `args` has mode, prompts, n, max_len, steps, rollout, device, max_age,
    the memory flags (`hand_keys`) and extra; colocated runs use every process of the job."""
    run = work / f"run_{args.mode}"
    out = [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={work / 'train.parquet'}",
        f"data.train_batch_size={args.prompts}",
        f"data.max_prompt_length={prompt_len}",
        f"data.max_response_length={args.max_len}",
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.model.tokenizer_path={tok_dir}",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.entropy_coeff=0",
        f"actor_rollout_ref.rollout.name={args.rollout}",
        f"actor_rollout_ref.rollout.n={args.n}",
        f"custom_reward_function.path={work / 'reward.py'}",
        "trainer.logger=[]",
        f"trainer.run_dir={run}",
        f"trainer.default_local_dir={run / 'ckpt'}",
        f"trainer.total_training_steps={args.steps}",
        "trainer.val_before_train=False",
        "trainer.resume_mode=disable",
        f"trainer.device={args.device}",
        "trainer.progress_bar=False",
    ]
    if args.mode == "offpolicy":
        world = int(os.environ.get("WORLD_SIZE", "2"))
        trainers, tp = getattr(args, "trainers", 1), getattr(args, "rollout_tp", 1)
        out += ["actor_rollout_ref.hybrid_engine=False", f"async_training.max_trajectory_age_steps={args.max_age}",
                f"trainer.n_gpus_per_node={trainers}", f"rollout.n_gpus_per_node={world - trainers}",
                f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}"]
    else:
        out += [f"trainer.n_gpus_per_node={int(os.environ.get('WORLD_SIZE', '1'))}"]  # plain python: one process
    return out + hand_keys(args) + list(args.extra)


def run(args, cfg, lengths: type = None) -> list[dict] | None:
    """This process's part of the job (`args.mode`, `args.steps`; every engine wrapped in `lengths`, a
    `ForcedLengths` class); the step metrics on the process that logs them (rank 0), else None."""
    from polyrl.trainer.ppo import PPOTrainer

    make_engine, wrap = PPOTrainer._make_engine, lengths or ForcedLengths
    # a stream per data shard / rollout replica (rollout.seed is offset by either)
    PPOTrainer._make_engine = lambda self: wrap(make_engine(self), args.mean_len, args.max_len,
                                                seed=1000 * self.cfg.actor_rollout_ref.rollout.seed)
    if args.mode == "offpolicy":
        from polyrl.trainer.async_ppo import AsyncPPOTrainer, RolloutWorker, join_job

        rank, env, link, place = join_job(cfg)
        if not place.is_trainer(rank):
            RolloutWorker(cfg, env, link, place, rank).serve()
            return None
        trainer = AsyncPPOTrainer(cfg, env, link, place)
        steps = [_timed_step(trainer) for _ in range(args.steps)]
        trainer.finish()
        env.barrier()
        return steps if env.is_rank0 else None
    trainer = PPOTrainer(cfg)
    steps = [_timed_step(trainer) for _ in range(args.steps)]
    trainer.dist.finish()
    return steps if trainer.dist.is_rank0 else None


def _timed_step(trainer) -> dict:
    t0 = time.perf_counter()
    m = trainer.step()
    m["bench/step_wall_s"] = time.perf_counter() - t0
    keys = ("timing_s/step", "timing_s/gen", "timing_s/exposed_generation", "timing_s/rollout_idle",
            "timing_s/update_actor", "timing_s/update_weights", "timing_s/behaviour_log_prob", "timing_s/old_log_prob",
            "perf/total_num_tokens", "perf/throughput", "response_length/mean", "response_length/max",
            "async/partial_rollout/frac_rows_resumed", "async/partial_rollout/gen_calls",
            "async/partial_rollout/rows_continued_on_kept_cache", "async/partial_rollout/groups_in_flight")
    if trainer.dist.is_rank0:
        print(f"step {trainer.global_step}: " + " ".join(f"{k.rsplit('/', 1)[1]}={m[k]:.2f}" for k in keys if k in m),
              flush=True)
    return m


def add_placement_args(ap) -> None:
    ap.add_argument("--trainers", type=int, default=1, help="offpolicy: trainer processes (the rest generate)")
    ap.add_argument("--rollout-tp", type=int, default=1, help="offpolicy: processes per rollout replica (TP)")


def placement_words(args, world: int) -> str:
    if args.mode != "offpolicy":
        return f"colocated, {world}-GPU data parallel"
    rollout = world - args.trainers
    return (f"{rollout} rollout GPU{'s' if rollout > 1 else ''} ({rollout // args.rollout_tp} replica"
            f"{'s' if rollout // args.rollout_tp > 1 else ''} of TP {args.rollout_tp}) + {args.trainers} train GPU"
            f"{'s' if args.trainers > 1 else ''}, max age {args.max_age}")


def main(argv=None) -> None:
    from grpo_step import rollout_name, setup

    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["colocated", "offpolicy"], required=True)
    ap.add_argument("--shape", default="1.5b", choices=["1.5b", "7b", "tiny"])
    ap.add_argument("--prompts", type=int, default=64, help="global batch, prompts per step")
    ap.add_argument("--n", "--samples-per-prompt", dest="n", type=int, default=8)
    ap.add_argument("--mean-len", type=int, default=1000)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2, help="leading steps left out of the average")
    ap.add_argument("--max-age", type=int, default=1, help="async_training.max_trajectory_age_steps (offpolicy)")
    add_placement_args(ap)
    # memory keys: the product's defaults (auto: learner/memory.py) unless set here (the 2026-11-25 first run used
    # --grad-ckpt on --max-token-len 32768 --gpu-mem-colocated 0.3 --gpu-mem-rollout 0.6, compile off)
    ap.add_argument("--max-token-len", type=int, default=None, help="ppo/log_prob_max_token_len_per_gpu (auto)")
    ap.add_argument("--grad-ckpt", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--gpu-mem-colocated", type=float, default=None)
    ap.add_argument("--gpu-mem-rollout", type=float, default=None)
    ap.add_argument("--work", default="/tmp/offpolicy_bench")
    ap.add_argument("--rows-out", default=None)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--extra", nargs="*", default=[], help="extra polyrl train overrides")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    args = ap.parse_args(argv)
    from polyrl.config import build_config
    from polyrl.trainer.config import PPOConfig

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    assert world >= 2, "run under torchrun --nproc_per_node=N, N >= 2 (off-policy: a trainer and a rollout GPU)"
    work = Path(args.work) / args.shape
    work.mkdir(parents=True, exist_ok=True)
    ready = work / f"ready-{os.environ.get('TORCHELASTIC_RUN_ID', 'single')}"
    if rank == 0:
        setup(work, init_std=0.01, num_prompts=args.prompts * (args.steps + 1), prompt_tokens=128, shape=args.shape,
              device=args.device)
        ready.write_text("ok")
    while not ready.exists():
        time.sleep(0.5)
    args.rollout = rollout_name() if args.device == "cuda" else "hf"
    named = [e.split("=", 1)[1] for e in args.extra if e.startswith("actor_rollout_ref.rollout.name=")]
    args.rollout = named[-1] if named else args.rollout  # --extra's wins (as in the config)
    cfg = build_config(PPOConfig(), overrides(args, work, work / "model", work / "tokenizer"))
    steps = run(args, cfg)
    if steps is None:
        return
    timed = steps[args.warmup:]
    tokens = sum(m["perf/total_num_tokens"] for m in timed)
    wall = sum(m["timing_s/step"] for m in timed)
    tps_gpu = tokens / (wall * world)
    per_step = [m["perf/total_num_tokens"] / (m["timing_s/step"] * world) for m in timed]
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    summary = {"mode": args.mode, "shape": args.shape, "device": f"{world}x {device}", "tokens_per_s_per_gpu": tps_gpu,
               "split": placement_words(args, world),
               "step_s": wall / len(timed), "tokens_per_step": tokens / len(timed),
               "exposed_generation_s": float(np.mean([m.get("timing_s/exposed_generation", 0) for m in timed])),
               "gen_s": float(np.mean([m.get("timing_s/gen", 0) for m in timed])),
               "update_actor_s": float(np.mean([m.get("timing_s/update_actor", 0) for m in timed])),
               "update_weights_s": float(np.mean([m.get("timing_s/update_weights", 0) for m in timed])),
               "rollout": args.rollout, "tokens_per_s_per_gpu_each_step": per_step,
               "median_tokens_per_s_per_gpu": float(np.median(per_step))}
    partial = {k.rsplit("/", 1)[1]: float(np.mean([m[k] for m in timed])) for k in timed[0]
               if k.startswith("async/partial_rollout/")}
    summary.update(partial)
    print("SUMMARY " + json.dumps(summary), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"summary": summary, "steps": steps}, indent=1, default=str))
    if args.rows_out:
        from _record import append_row

        model = {"1.5b": "Qwen2.5-1.5B", "7b": "Qwen2.5-7B", "tiny": "tiny 2-layer"}[args.shape]
        split = placement_words(args, world)
        memory = " ".join(hand_keys(args)) or "memory keys auto (defaults)"
        extra = f"; {' '.join(args.extra)}" if args.extra else ""
        shape = (f"GRPO whole step, {model} shape, {args.prompts}x{args.n}, prompt 128, lognormal resp mean "
                 f"{args.mean_len} max {args.max_len}; {split}; {memory}{extra}; step {summary['step_s']:.1f}s, gen "
                 f"{summary['gen_s']:.1f}s, exposed gen {summary['exposed_generation_s']:.1f}s, update "
                 f"{summary['update_actor_s']:.1f}s, weights {summary['update_weights_s']:.2f}s; {len(timed)} timed "
                 f"steps (after {args.warmup}), each: {', '.join(f'{t:.0f}' for t in per_step)} tok/s/GPU"
                 + "".join(f"; {k} {v:.2f}" for k, v in partial.items()))
        append_row(summary["device"], f"offpolicy_step ({args.mode}) tok/s/GPU", shape, f"{tps_gpu:.0f}",
                   peer="NeMo RL Llama-3.1-8B 16xH100: 1562 on-policy, 2161 1-step off (1.38x)",
                   path=args.rows_out)


if __name__ == "__main__":
    main()
