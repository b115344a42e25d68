"""Actor update throughput and MFU on one GPU: polyrl's engine vs plain HF, Qwen2.5-1.5B shape, ~2k-token sequences.

    PYTHONPATH=. python benchmarks/train_step.py --rows-out history
    PYTHONPATH=. python benchmarks/train_step.py --shape 30b-a3b --layers 4 --num-seqs 64 \
        --variants compiled,compiled_hfexperts --profile

`--shape 30b-a3b` is Qwen3-30B-A3B's shape cut to `--layers` layers (issue 47's training MFU on the active
parameters); the `_hfexperts` suffix keeps transformers' own experts forward instead of polyrl's
(models/moe.grouped_experts), to show what that forward costs.

Work per optimizer step (the same for every variant): 16 sequences of 128 prompt + 1536..1920 response tokens (random
ids, random advantages), one PPO mini-batch, AdamW on fp32 master weights, bf16 autocast compute.
- polyrl: `Actor.update` (packed varlen attention, token-budget micro-batches, chunked log-probs from hidden states),
  with and without gradient checkpointing, and with `torch.compile` on each decoder layer.
- plain HF: padded micro-batches of 4 rows, `model(...).logits` -> fp32 log_softmax, gradient checkpointing (the way
  a straightforward HF training loop does it).
MFU = polyrl.learner.flops.training_flops (6*N*tokens + attention, recomputation not counted) / time / 989e12. It also
measures the peak memory of naive vs chunked log-prob+entropy forward+backward on 16k tokens.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from polyrl.algorithms.losses import LossKnobs  # noqa: E402
from polyrl.learner.actor import Actor, ForwardSettings, UpdateSettings, make_scheduler  # noqa: E402
from polyrl.learner.batch import build_batch  # noqa: E402
from polyrl.learner.flops import mfu, peak_flops, training_flops  # noqa: E402
from polyrl.learner.logprobs import chunked_logprobs, naive_logprobs  # noqa: E402


def qwen25_1_5b(init_std: float = 0.02):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                       rope_theta=1e6, tie_word_embeddings=True, initializer_range=init_std, use_cache=False)


def build_model(cfg, *, grad_ckpt: bool, seed: int = 0):
    from transformers import AutoModelForCausalLM

    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def make_batch(num_seqs: int, prompt_len: int, resp_min: int, resp_max: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(resp_min, resp_max + 1, (num_seqs,), generator=g).tolist()
    prompts = [torch.randint(10, vocab, (prompt_len,), generator=g).tolist() for _ in range(num_seqs)]
    resps = [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lens]
    b = build_batch(prompts, resps, pad_token_id=0, device=torch.device("cuda"))
    b["advantages"] = torch.randn(b["responses"].shape, generator=g).cuda() * b["response_mask"]
    return b


def settings(num_seqs, max_token_len):
    return UpdateSettings(mini_batch_size=num_seqs, micro_batch_size=num_seqs, ppo_epochs=1, temperature=1.0,
                          loss_mode="vanilla", loss_agg_mode="token-mean", knobs=LossKnobs(), grad_clip=1.0,
                          entropy_coeff=0.0, use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="low_var_kl",
                          calculate_entropy=True, old_from_current=True, max_token_len=max_token_len)


def optimizer_for(params, lr=1e-6):
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)
    return opt, make_scheduler(opt, total_steps=100, warmup_steps=0, kind="constant", min_lr_ratio=0.0,
                               num_cycles=0.5)


def timed(fn, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times


def run_polyrl(cfg, batch, *, grad_ckpt, max_token_len, compile_layers, warmup, steps, profile=None,
               fused_head=True, offload=False, hf_experts=False):
    model = build_model(cfg, grad_ckpt=grad_ckpt)
    opt, sched = optimizer_for(model.parameters())
    fwd = ForwardSettings(compile_layers=compile_layers, fused_head=fused_head, activation_offload=offload)
    actor = Actor(model, opt, sched, fwd=fwd)
    for mod in model.modules() if hf_experts else ():  # undo models/moe.grouped_experts (compile traces lazily)
        if "_hf_forward" in vars(mod):
            mod.forward = mod._hf_forward
    s = settings(batch["responses"].shape[0], max_token_len)
    torch.cuda.reset_peak_memory_stats()
    t_compile = time.perf_counter()
    last = {}

    def step():
        last.update(actor.update(batch, s))

    times = timed(fn=step, warmup=warmup, steps=steps)
    first = time.perf_counter() - t_compile - sum(times)
    if profile:
        kernel_breakdown(step, profile)
    peak = torch.cuda.max_memory_allocated() / 2**30
    del actor, opt, model
    torch.cuda.empty_cache()
    return times, peak, last, first


def kernel_breakdown(step, label: str) -> None:
    """GPU time of one step by kernel family (torch.profiler), to see what the MFU gap is made of."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    fams: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_type.name != "CUDA":
            continue
        n = e.key.lower()
        fam = ("gemm" if any(k in n for k in ("gemm", "sm90", "cutlass", "xmma", "nvjet")) else
               "attention" if any(k in n for k in ("flash", "fmha", "attn")) else
               "triton(fused)" if "triton" in n else
               "copy/cast" if any(k in n for k in ("copy", "cast", "convert")) else
               "optimizer" if any(k in n for k in ("adam", "foreach", "multi_tensor")) else "other elementwise")
        fams[fam] = fams.get(fam, 0.0) + e.self_device_time_total / 1e6
    total = sum(fams.values())
    print(f"[{label}] GPU time by family, one step ({total:.3f} s busy): " + ", ".join(
        f"{k} {v:.3f}s ({v / total:.0%})" for k, v in sorted(fams.items(), key=lambda kv: -kv[1])), flush=True)
    top = sorted((e for e in prof.key_averages() if e.device_type.name == "CUDA"),
                 key=lambda e: -e.self_device_time_total)[:12]
    for e in top:
        print(f"   {e.self_device_time_total / 1e3:8.1f} ms  x{e.count:<5d} {e.key[:110]}", flush=True)


def run_hf(cfg, batch, *, micro_rows, warmup, steps):
    """A plain HF loop: padded rows, full logits, fp32 log_softmax, grad checkpointing, autocast bf16."""
    model = build_model(cfg, grad_ckpt=True)
    opt, _ = optimizer_for(model.parameters())
    B, T = batch["responses"].shape
    num_tokens = batch["response_mask"].sum()

    def step():
        opt.zero_grad(set_to_none=True)
        for start in range(0, B, micro_rows):
            rows = slice(start, start + micro_rows)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=batch["input_ids"][rows], attention_mask=batch["attention_mask"][rows],
                               position_ids=batch["position_ids"][rows]).logits[:, -T - 1:-1]
            logp = torch.log_softmax(logits.float(), -1).gather(-1, batch["responses"][rows, :, None])[..., 0]
            mask = batch["response_mask"][rows]
            loss = -(logp * batch["advantages"][rows] * mask).sum() / num_tokens  # no entropy (polyrl computes it)
            loss.backward()
            del logits, logp
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    torch.cuda.reset_peak_memory_stats()
    times = timed(step, warmup, steps)
    peak = torch.cuda.max_memory_allocated() / 2**30
    del model, opt
    torch.cuda.empty_cache()
    return times, peak


def logprob_memory(cfg, num_tokens=16384, chunk=2048):
    """Peak memory above the inputs of log-prob+entropy forward+backward: naive full fp32 logits vs chunked."""
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(num_tokens, cfg.hidden_size, device="cuda", generator=g, requires_grad=True)
    w = (torch.randn(cfg.vocab_size, cfg.hidden_size, device="cuda", generator=g) * 0.02).requires_grad_()
    y = torch.randint(0, cfg.vocab_size, (num_tokens,), device="cuda", generator=g)
    out = {}
    for name, fn in (("naive", lambda: naive_logprobs(h, w, y, with_entropy=True)),
                     ("chunked", lambda: chunked_logprobs(h, w, y, with_entropy=True, chunk_size=chunk))):
        h.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logp, ent = fn()
        (logp.sum() + ent.sum()).backward()
        torch.cuda.synchronize()
        out[name] = ((torch.cuda.max_memory_allocated() - base) / 2**30, time.perf_counter() - t)
        del logp, ent
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-seqs", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--resp-min", type=int, default=1536)
    ap.add_argument("--resp-max", type=int, default=1920)
    ap.add_argument("--max-token-len", type=int, default=16384)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--variants", default="packed,packed_ckpt,hf,compiled",
                    help="comma list: hf, or packed/compiled plus any of _ckpt, _offload, _unfused")
    ap.add_argument("--shape", choices=["qwen2.5-1.5b", "30b-a3b"], default="qwen2.5-1.5b")
    ap.add_argument("--layers", type=int, default=4, help="30b-a3b: keep the first N of its 48 layers")
    ap.add_argument("--rows-out", default=None)
    ap.add_argument("--profile", action="store_true", help="print GPU time by kernel family per variant")
    args = ap.parse_args(argv)
    if args.shape == "30b-a3b":
        from moe_step import qwen3_30b_a3b

        cfg = qwen3_30b_a3b(layers=args.layers, use_cache=False)
    else:
        cfg = qwen25_1_5b()
    batch = make_batch(args.num_seqs, args.prompt_len, args.resp_min, args.resp_max, cfg.vocab_size)
    lengths = batch["attention_mask"].sum(1).tolist()
    tokens = sum(lengths)
    flops = training_flops(cfg, lengths, lm_head_tokens=int(batch["response_mask"].sum()))
    device = torch.cuda.get_device_name()
    peak = peak_flops()
    print(f"device {device}; {args.num_seqs} seqs, {tokens} tokens/step, {flops / 1e12:.1f} TFLOP/step, peak "
          f"{peak / 1e12:.0f} TFLOP/s", flush=True)
    results = {}
    for v in args.variants.split(","):
        try:
            if v == "hf":
                times, mem = run_hf(cfg, batch, micro_rows=4, warmup=args.warmup, steps=args.steps)
                extra = ""
            else:
                times, mem, last, first = run_polyrl(cfg, batch, grad_ckpt="ckpt" in v,
                                                     max_token_len=args.max_token_len,
                                                     compile_layers="compiled" in v, warmup=args.warmup,
                                                     steps=args.steps,
                                                     fused_head="unfused" not in v, offload="offload" in v,
                                                     hf_experts="hfexperts" in v,
                                                     profile=v if args.profile else None)
                extra = f"warmup+compile {first:.1f}s; update's own perf/mfu/actor {last.get('perf/mfu/actor', 0):.1%}"
        except Exception as e:  # one variant failing (OOM, compile) must not lose the others
            print(f"{v}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            torch.cuda.empty_cache()
            continue
        t = sorted(times)[len(times) // 2]
        results[v] = (tokens / t, mfu(flops, t), mem)
        print(f"{v:12s} step {t:.3f}s  {tokens / t:9.0f} tok/s  MFU {mfu(flops, t):.1%}  peak mem {mem:.1f} GiB  "
              f"{extra}", flush=True)
    from polyrl.learner import packing

    print(f"varlen kernel: {'torch varlen_attn' if packing._VARLEN and not packing._VARLEN_BROKEN else 'SDPA fallback'}"
          f" {packing._VARLEN_BROKEN[:1]}", flush=True)
    mem = logprob_memory(cfg) if args.shape != "30b-a3b" else None  # the dense head's question; MoE: memory is full
    if mem:
        naive, chunked = mem["naive"], mem["chunked"]
        print(f"log-prob+entropy fwd+bwd on 16384 tokens x {cfg.vocab_size} vocab: naive {naive[0]:.2f} GiB "
              f"({naive[1] * 1e3:.0f} ms), chunked {chunked[0]:.2f} GiB ({chunked[1] * 1e3:.0f} ms)")
    print("\n| variant | tok/s | MFU | peak GiB |\n|---|---|---|---|")
    for v, (tps, m, gb) in results.items():
        print(f"| {v} | {tps:.0f} | {m:.1%} | {gb:.1f} |")
    ours = [k for k in results if k != "hf" and "hfexperts" not in k]
    if args.rows_out and ours:
        from _record import append_row

        best = max(ours, key=lambda k: results[k][0])
        tps, m, _ = results[best]
        moe = args.shape == "30b-a3b"
        name = f"Qwen3-30B-A3B shape cut to {args.layers} of 48 layers, MFU on active parameters" if moe else \
            "Qwen2.5-1.5B shape"
        shape = (f"{name}, {args.num_seqs}x({args.prompt_len}+{args.resp_min}-{args.resp_max}) tok, "
                 f"actor update ({best}), bf16 autocast/fp32 master")
        peer_key = f"{best}_hfexperts" if moe else "hf"
        peer = results.get(peer_key)
        peer_name = "transformers' experts forward" if moe else "plain HF padded+ckpt"
        append_row(device, "train_step 30b-a3b" if moe else "train_step tok/s (MFU)", shape, f"{tps:.0f} ({m:.1%})",
                   peer=f"{peer_name}: {peer[0]:.0f} ({peer[1]:.1%})" if peer else "-",
                   limit=f"{tokens / (flops / peak):.0f} (100% of 989 TFLOP/s)",
                   ratio_peer=f"{tps / peer[0]:.2f}x" if peer else "-", ratio_limit=f"{m:.1%}", path=args.rows_out)
        if not moe:
            append_row(device, "logprob+entropy peak mem", "16384 tok x 151936 vocab, fwd+bwd, bf16 autocast",
                       f"chunked {mem['chunked'][0]:.2f} GiB", peer=f"naive fp32 logits: {mem['naive'][0]:.2f} GiB",
                       ratio_peer=f"{mem['chunked'][0] / mem['naive'][0]:.2f}x", path=args.rows_out)

if __name__ == "__main__":
    main()
