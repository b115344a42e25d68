"""Data-parallel scaling of the actor update and the weight-sync time, 1 vs N processes (torchrun).

    torchrun --nproc_per_node=1 benchmarks/multi_gpu.py --shape 1.5b     # baseline
    torchrun --nproc_per_node=2 benchmarks/multi_gpu.py --shape 1.5b     # FSDP2 over 2 GPUs
    torchrun --nproc_per_node=2 benchmarks/multi_gpu.py --shape 1.5b --sp 2   # Ulysses: 2 GPUs share each row

Weak scaling: every rank trains the same number of sequences, so perfect scaling keeps tokens/s/GPU constant. Each
step's global batch (seqs-per-gpu x N long-tailed sequences) is drawn once and dealt out to ranks as the trainer does
with `trainer.balance_batch` (equal rows, balanced tokens; `--no-balance`: contiguous slices);
`efficiency = tokens/s/GPU(N) / tokens/s/GPU(1)` (pass `--baseline` with the 1-process number). The model is a
random-init model of the named shape (no downloads), trained with polyrl's `Actor.update` (packed, bf16 autocast,
chunked log-probs) exactly as the trainer does; N=1 is the plain single-process path, N>1 goes through
`polyrl.distributed.parallelize`. Weight sync is `full_tensors` streamed into a bf16 replica (what each rank's
rollout engine receives). What is NOT measured here: rollout, so this is the update_actor + update_weights share of a
GRPO step, not the whole step. The limit printed is bf16 dense peak (~989 TFLOP/s on H100/H200) via 6*N*tokens FLOPs.

`--sp S` (Ulysses sequence parallelism, polyrl/distributed/ulysses.py): groups of S consecutive ranks train the same
rows, each holding 1/S of every packed micro-batch, so the batch is dealt to N/S data shards; to keep the per-GPU work
of the plain run a shard trains S x `--seqs-per-gpu` sequences in micro-batches of S x `--micro`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {  # Qwen2.5 shapes (config.json values); tiny for CPU smoke runs
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}


def build(shape: str, device: torch.device):
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(max_position_embeddings=4096, **SHAPES[shape])
    with device:
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def batch_for(num_seqs: int, prompt_len: int, resp_len: int, vocab: int, device, seed: int):
    from polyrl.learner.batch import build_batch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(10, vocab, (prompt_len,), generator=g).tolist() for _ in range(num_seqs)]
    # long-tailed response lengths, as in GRPO
    lens = (torch.rand(num_seqs, generator=g) ** 2 * (resp_len - 16) + 16).long().tolist()
    resps = [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lens]
    b = build_batch(prompts, resps, pad_token_id=0, device=device)
    b["advantages"] = torch.randn(b["responses"].shape, generator=g).to(device) * b["response_mask"]
    b["old_log_probs"] = torch.zeros_like(b["response_mask"])
    return b


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--seqs-per-gpu", type=int, default=16)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--resp-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one warmup step")
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    ap.add_argument("--no-ckpt", action="store_true", help="no gradient checkpointing")
    ap.add_argument("--no-balance", dest="balance", action="store_false",
                    help="contiguous shards instead of trainer.balance_batch's token-balanced ones")
    ap.add_argument("--baseline", type=float, default=None, help="1-process tokens/s/GPU, for the efficiency")
    ap.add_argument("--record", action="store_true", help="append a row to benchmarks/history.jsonl (rank 0)")
    ap.add_argument("--out", default=None, help="append the JSON result to this file (rank 0)")
    ap.add_argument("--forward-prefetch", action="store_true", help="fsdp_config.forward_prefetch=True (N > 1)")
    ap.add_argument("--sp", type=int, default=1, help="Ulysses sequence-parallel degree (divides the process count)")
    args = ap.parse_args()

    from polyrl.algorithms.losses import LossKnobs
    from polyrl.distributed import DistEnv
    from polyrl.distributed.parallelize import param_groups, parallelize
    from polyrl.distributed.weights import full_tensors
    from polyrl.learner.actor import Actor, ForwardSettings, UpdateSettings, make_scheduler
    from polyrl.learner.batch import select, trim_columns
    from polyrl.learner.dynamic_batch import equal_size_partition
    from polyrl.learner.config import FSDPConfig

    env = DistEnv.setup("auto", sp_size=args.sp)
    torch.manual_seed(0)
    model = build(args.shape, env.device)
    replica = build(args.shape, env.device).to(torch.bfloat16)  # what a rollout engine holds
    if env.is_distributed:
        parallelize(model, env.mesh, FSDPConfig(forward_prefetch=args.forward_prefetch), env.device)
    if not args.no_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(param_groups(model), lr=1e-6)
    sched = make_scheduler(opt, total_steps=100, warmup_steps=0, kind="constant", min_lr_ratio=0.0, num_cycles=0.5)
    actor = Actor(model, opt, sched, dp=env, fwd=ForwardSettings(compile_layers=args.compile))
    seqs_per_shard = args.seqs_per_gpu * args.sp  # one data shard = one SP group (one rank without --sp)
    s = UpdateSettings(mini_batch_size=seqs_per_shard, micro_batch_size=args.micro * args.sp, ppo_epochs=1,
                       temperature=1.0, loss_mode="vanilla", loss_agg_mode="token-mean",
                       knobs=LossKnobs(loss_scale_factor=float(args.resp_len)), grad_clip=1.0,
                       entropy_coeff=0.0, use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="low_var_kl",
                       calculate_entropy=False, old_from_current=True)
    vocab = SHAPES[args.shape]["vocab_size"]
    params = dict(replica.named_parameters())
    sync = lambda: [params[n].copy_(t) for n, t in full_tensors(model.named_parameters()) if n in params]  # noqa
    cuda = env.device.type == "cuda"
    times, syncs, tokens = [], [], []
    for step in range(args.steps + 1):
        # the job's global batch (same on every rank), dealt out as the trainer does: balanced (trainer.balance_batch)
        # or in contiguous slices
        batch = batch_for(args.seqs_per_gpu * env.world_size, args.prompt_len, args.resp_len, vocab, env.device,
                          seed=1000 * step)
        lengths = batch["attention_mask"].sum(1).tolist()
        share = (equal_size_partition(lengths, env.dp_size)[env.dp_rank] if args.balance else
                 list(range(env.dp_rank * seqs_per_shard, (env.dp_rank + 1) * seqs_per_shard)))
        batch = trim_columns(select(batch, torch.tensor(share, device=env.device)))
        env.barrier()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        actor.update(batch, s)
        if cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        with torch.no_grad():
            sync()
        if cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        if step:  # step 0 warms up allocator, kernels and NCCL communicators
            times.append(float(env.all_reduce(torch.tensor(t1 - t0, device=env.device), op="max")))
            syncs.append(float(env.all_reduce(torch.tensor(t2 - t1, device=env.device), op="max")))
            tokens.append(sum(lengths) / env.world_size)
    tok_s_gpu = sum(tokens) / sum(times)  # the job's tokens per GPU over the slowest rank's time
    n_params = sum(p.numel() for p in replica.parameters())
    tflops = 6 * n_params * tok_s_gpu / 1e12
    peak = 989.0 if cuda else float("nan")
    out = dict(shape=args.shape, world_size=env.world_size, sp=args.sp, seqs_per_gpu=args.seqs_per_gpu,
               micro=args.micro, forward_prefetch=args.forward_prefetch, compile=args.compile, ckpt=not args.no_ckpt,
               balanced=args.balance,
               prompt_len=args.prompt_len, resp_len=args.resp_len, update_tokens_per_s_per_gpu=round(tok_s_gpu, 1),
               update_s=round(sum(times) / len(times), 3), weight_sync_s=round(sum(syncs) / len(syncs), 4),
               model_tflops_per_gpu=round(tflops, 1), limit_tflops=peak, mfu=round(tflops / peak, 3),
               efficiency_vs_1=None if not args.baseline else round(tok_s_gpu / args.baseline, 3),
               peak_mem_gb=round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None,
               device=torch.cuda.get_device_name() if cuda else "cpu")
    if env.is_rank0:
        print(json.dumps(out), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(out) + "\n")
        if args.record:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from _record import append_row

            eff = f", {out['efficiency_vs_1']:.0%} of 1-GPU tokens/s/GPU" if args.baseline else ""
            append_row(f"{env.world_size}x {out['device']}", "multi_gpu (update_actor + weight sync)",
                       f"Qwen2.5-{args.shape} shape, {args.seqs_per_gpu} seqs/GPU x {args.prompt_len}+<={args.resp_len}"
                       f" tok, micro {args.micro}, FSDP2 bf16, {'no ckpt' if args.no_ckpt else 'grad ckpt'}"
                       f"{', compiled' if args.compile else ''}{', forward_prefetch' if args.forward_prefetch else ''}"
                       f"{f', Ulysses sp={args.sp}' if args.sp > 1 else ''}, "
                       f"{'balance_batch' if args.balance else 'contiguous shards'}",
                       f"{tok_s_gpu:.0f} tok/s/GPU{eff}; weight sync {out['weight_sync_s']} s",
                       limit=f"{peak:.0f} TFLOP/s bf16", ratio_limit=f"MFU {out['mfu']}")
    env.close()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
