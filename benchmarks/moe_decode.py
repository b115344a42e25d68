"""Qwen3-30B-A3B decode on one GPU against its bandwidth roofline, and the expert GEMMs per regime (issue 47).

    PYTHONPATH=. python benchmarks/moe_decode.py --config fp8kv_w8 --rows-out BENCHMARKS.md   # fits an H100
    PYTHONPATH=. python benchmarks/moe_decode.py --config bf16 --rows-out BENCHMARKS.md       # 109 GB: an H200
    PYTHONPATH=. python benchmarks/moe_decode.py --config bf16 --layers 24                    # the cut fits an H100
    PYTHONPATH=. python benchmarks/moe_decode.py --gemms                                      # grouped-GEMM table
    PYTHONPATH=. python benchmarks/moe_decode.py --config fp8kv_w8 --layers 8 --profile       # where a step goes

The model is Qwen3-30B-A3B's shape with random weights, built straight into the engine's layout (no HF model, no
download): 48 layers (`--layers N` cuts), hidden 2048, 128 experts top-8 with moe_intermediate 768, 32 q / 4 kv heads
of 128, vocab 151,936, untied head. The router is spread (std 1) so that tokens pick experts near uniformly, as a
trained router roughly does.

Engine (default): 256 rows (`--rows`) with distinct random prompts, forced lengths of `--new` tokens, EOS ignored;
prompt length = `--context` - new/2, so a decode step's mean context is `--context` (2k). We time the decode steps'
GPU time (the engine's `decode_gpu_s`: CUDA events from the first decode step to the last) and count their tokens
(every row's tokens after the first, which prefill samples). Configs: bf16; fp8kv (rollout.kv_cache_dtype=fp8);
fp8kv_w8 (+ rollout.quantization=fp8: e4m3 experts through `torch._scaled_grouped_mm`, e4m3 attention GEMMs).
Memory: the full model needs 61 GB of bf16 weights (30.5 GB in FP8) plus the KV cache, 96 KiB a token in bf16 (48 KiB
+ scales in FP8): 256 x 2k tokens is 48 GiB in bf16. So bf16 needs an H200, and fp8kv_w8 fits an H100.

Roofline: a decode step reads every weight it touches once and every row's context K/V. Touched: attention, norms,
router and LM head always (the embedding table is not read, only B rows of it); of each MoE layer's E experts, the
expected number that B rows x k picks reach, E (1 - (1 - k/E)^B) (uniform routing: 128 of 128 at 256 rows). Bytes
are the config's own (e4m3 + scales in FP8), also given for bf16, over the copy bandwidth measured here
(`benchmarks/rollout.copy_bandwidth`, as every roofline in this repo). The issue's bar: 60% of it.

Grouped GEMMs (`--gemms`): one MoE layer's experts (gate_up GEMM, SiLU-and-multiply, down GEMM) at decode sizes
(1-512 token rows, so 8-4,096 (token, expert) pairs) and prefill sizes (2k-16k tokens), routing drawn uniformly:
`torch._grouped_mm` (bf16), `torch._scaled_grouped_mm` (e4m3
with row scales), and a per-expert loop of cuBLAS GEMMs (its host sync included, as the engine would pay it). One
layer's experts are 1.2 GB in bf16, far past the L2, so every call reads them from HBM as decode does. The last
lines print the per-regime winner (`_grouped_mm` won both on an H100, 2026-11-27, over a Triton grouped GEMM that
was then removed; the loop can never be the decode choice: CUDA graphs cannot capture its host sync).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

QWEN3_30B_A3B = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, qkv_bias=False,
                     qk_norm=True, tie_word_embeddings=False, max_position_embeddings=40960, num_experts=128,
                     num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True)
ROPE_THETA = 1e6
CONFIGS = {"bf16": dict(), "fp8kv": dict(kv_cache_dtype="fp8"),
           "fp8kv_w8": dict(kv_cache_dtype="fp8", quantization="fp8")}
DECODE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
PREFILL_TOKENS = (2048, 8192, 16384)


def spec(layers: int | None = None, **overrides):
    """Qwen3-30B-A3B's ModelSpec (every layer sparse), cut to `layers`."""
    from polyrl.rollout.native.model import ModelSpec

    kw = dict(QWEN3_30B_A3B, **overrides)
    if layers:
        kw["num_layers"] = layers
    return ModelSpec(moe_layers=tuple(range(kw["num_layers"])), **kw)


def expected_experts_touched(num_experts: int, top_k: int, rows: int) -> float:
    """Expected experts a decode step of `rows` tokens reaches in one layer, routing uniform: E (1 - (1 - k/E)^B)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** rows)


def step_weight_bytes(model, rows: int) -> float:
    """Bytes of the weights one decode step of `rows` rows reads: every parameter except the embedding table (B rows
    gathered) and, of each layer's experts, the expected touched share."""
    from polyrl.rollout.native.moe import Experts

    total = 0.0
    for name, p in model.named_parameters():
        if name.startswith("embed."):
            continue
        total += p.numel() * p.element_size()
    for layer in model.layers:
        ex = getattr(layer.mlp, "experts", None)
        if isinstance(ex, Experts):
            per_layer = sum(p.numel() * p.element_size() for p in ex.parameters())
            touched = expected_experts_touched(ex.num_experts, layer.mlp.top_k, rows) / ex.num_experts
            total -= per_layer * (1.0 - touched)
    return total


def bf16_step_weight_bytes(model, rows: int) -> float:
    """The same for the model in bf16 (FP8 scales dropped): the roofline a bf16 engine cannot beat."""
    total = 0.0
    for name, p in model.named_parameters():
        if name.startswith("embed.") or name.endswith("_scale"):
            continue
        total += p.numel() * 2
    s = model.spec
    expert_bytes = s.num_experts * 3 * s.hidden_size * s.moe_intermediate_size * 2
    touched = expected_experts_touched(s.num_experts, s.num_experts_per_tok, rows) / s.num_experts
    return total - len(s.moe_layers) * expert_bytes * (1.0 - touched)


def kv_bytes_per_token(s, fp8: bool) -> int:
    per_head = s.head_dim * (1 if fp8 else 2) + (4 if fp8 else 0)
    return 2 * s.num_layers * s.num_kv_heads * per_head


def decode_roofline(rows: int, prompt: int, new: int, weight_bytes: float, kv_tok: int, bw: float) -> float:
    """tok/s of the decode steps (new - 1 of them: the first token comes from prefill) at `bw` bytes/s: each step reads
    the weights and every row's context (prompt + tokens so far)."""
    steps = new - 1
    ctx_tokens = rows * sum(prompt + t for t in range(1, new))
    return rows * steps / ((steps * weight_bytes + ctx_tokens * kv_tok) / bw)


@torch.no_grad()
def build_model(s, device, fp8_experts: bool = False, seed: int = 0):
    """The engine's CausalLM with random weights, materialised layer by layer (with `fp8_experts` each layer's experts
    go to e4m3 before the next is made, so the full model never exists in bf16: 30.5 GB peak, not 91)."""
    from torch import nn

    from polyrl.rollout.native.model import CausalLM, MLP, RMSNorm
    from polyrl.rollout.native.moe import Experts, FP8Experts, MoE

    torch.manual_seed(seed)
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    with torch.device("meta"):
        model = CausalLM(s)

    def fill(module):
        module.to(dtype).to_empty(device=device)
        for m in module.modules():
            if isinstance(m, RMSNorm):
                m.weight.fill_(1.0)
            elif isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight.normal_(0, 0.02)
            elif isinstance(m, Experts):
                m.gate_up.normal_(0, 0.02)
                m.down.normal_(0, 0.02)
        for m in module.modules():
            if isinstance(m, MoE):
                m.router.weight.normal_(0, 1.0)  # spread: near-uniform expert choice

    for part in (model.embed, model.norm, model.lm_head):
        fill(part)
    for layer in model.layers:
        fill(layer)
        if fp8_experts and isinstance(layer.mlp, MoE):
            layer.mlp.experts = FP8Experts(layer.mlp.experts)
        assert isinstance(layer.mlp, (MoE, MLP))
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, s.head_dim, 2, dtype=torch.float32) / s.head_dim))
    return model, inv_freq


def run_engine(args, bw: float, dev_name: str, s=None, device: str = "cuda") -> dict:
    """The engine run (module docstring). `s` / `device`: another spec and device (CPU: the CI check of this code,
    with wall time standing in for the decode steps' GPU time)."""
    from polyrl.rollout.base import SamplingParams
    from polyrl.rollout.native import NativeEngine
    from polyrl.rollout.native import cuda_graph

    s = s or spec(args.layers)
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg = CONFIGS[args.config]
    prompt = args.context - args.new // 2
    max_len = prompt + args.new
    t0 = time.perf_counter()
    model, inv_freq = build_model(s, device, fp8_experts=cfg.get("quantization") == "fp8")
    model.set_rope(inv_freq, 1.0, max_len, device)
    eng = NativeEngine(model, device=device, gpu_memory_utilization=args.gpu_memory_utilization,
                       max_num_seqs=args.rows, max_num_batched_tokens=args.max_num_batched_tokens,
                       max_model_len=max_len,
                       enforce_eager=False, block_size=16, seed=0,
                       num_kv_tokens=None if cuda else args.rows * max_len, **cfg)
    print(f"built in {time.perf_counter() - t0:.0f} s: weights {eng.weight_bytes() / 1e9:.1f} GB, KV cache "
          f"{eng.num_blocks * eng.block_size:,} tokens (needs {args.rows * max_len:,})", flush=True)
    if eng.num_blocks * eng.block_size < args.rows * max_len:
        print("warning: the KV cache cannot hold every row at full length: rows will be preempted (the number is "
              "then not the shape's); use --config fp8kv_w8, --layers, or an H200", flush=True)
    prompts = torch.randint(0, s.vocab_size, (args.rows, prompt), generator=torch.Generator().manual_seed(0)).tolist()
    sp = SamplingParams(temperature=1.0, max_new_tokens=args.new, ignore_eos=True, seed=0,
                        forced_lengths=[args.new] * args.rows)
    # warm-up: every batch size captured and every Triton kernel compiled outside the timed run
    after, cuda_graph.CAPTURE_AFTER = cuda_graph.CAPTURE_AFTER, 1
    eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True, seed=0,
                                         forced_lengths=[4] * args.rows))
    cuda_graph.CAPTURE_AFTER = after
    sync()
    t0 = time.perf_counter()
    out = eng.generate(prompts, sp)
    sync()
    wall = time.perf_counter() - t0
    assert out.lengths == [args.new] * args.rows
    st = dict(eng.stats)
    if not cuda:
        st["decode_gpu_s"] = wall
    decode_tokens = args.rows * (args.new - 1)
    tps = decode_tokens / st["decode_gpu_s"]
    fp8_kv = cfg.get("kv_cache_dtype") == "fp8"
    W, Wb = step_weight_bytes(eng.model, args.rows), bf16_step_weight_bytes(eng.model, args.rows)
    roof = decode_roofline(args.rows, prompt, args.new, W, kv_bytes_per_token(s, fp8_kv), bw)
    roof_bf16 = decode_roofline(args.rows, prompt, args.new, Wb, kv_bytes_per_token(s, False), bw)
    r = dict(benchmark="moe_decode", device=dev_name, config=args.config, layers=s.num_layers, rows=args.rows,
             prompt=prompt, new=args.new, decode_tokens_per_s=tps, decode_gpu_s=st["decode_gpu_s"],
             ms_per_step=st["decode_gpu_s"] / max(st["num_decode_steps"], 1) * 1e3, wall_s=wall,
             prefill_gpu_s=st["prefill_gpu_s"], preempted=st["num_preempted"], step_weight_gb=W / 1e9,
             roofline=roof, roofline_bf16=roof_bf16, frac_roofline=tps / roof, frac_roofline_bf16=tps / roof_bf16,
             copy_bw_tbs=bw / 1e12, peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0)
    print(json.dumps(r), flush=True)
    print(f"decode {tps:,.0f} tok/s ({r['ms_per_step']:.2f} ms a step) = {tps / roof:.0%} of the roofline "
          f"{roof:,.0f} ({args.config}; {tps / roof_bf16:.0%} of bf16's {roof_bf16:,.0f}); bar: 60%", flush=True)
    if getattr(args, "profile", False):  # kernel breakdown of a decode-heavy run: 64-token prompts, 64 new tokens
        from rollout import profile_decode

        short = [p[:64] for p in prompts]
        profile_decode(eng, s.vocab_size, short, SamplingParams(temperature=1.0, max_new_tokens=64, ignore_eos=True,
                                                                seed=0), label=f"[moe_decode {args.config}]")
    if args.rows_out:
        from _record import append_row

        append_row(dev_name, "moe_decode.py (engine, decode only)",
                   f"Qwen3-30B-A3B shape, random weights, {s.num_layers} layers, 128 experts top-8; {args.rows} rows "
                   f"x P{prompt} + {args.new} new (mean decode context {args.context}); {args.config}; "
                   f"{r['ms_per_step']:.2f} ms a step; weights read a step {W / 1e9:.1f} GB; preempted "
                   f"{r['preempted']}; experts torch._grouped_mm",
                   f"{tps:,.0f} decode tok/s", "-", f"roofline {roof:,.0f} ({args.config}), bf16 {roof_bf16:,.0f} "
                   f"(copy BW {bw / 1e12:.2f} TB/s)", "-", f"{tps / roof:.0%} ({tps / roof_bf16:.0%} of bf16)",
                   args.rows_out)
    return r


def routed_pairs(tokens: int, num_experts: int, top_k: int, device, seed: int = 0):
    """Uniform top-k routing of `tokens` tokens: (ids [T, k], the sort order and offsets the engine computes)."""
    from polyrl.rollout.native.moe import sort_by_expert

    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.rand(tokens, num_experts, generator=g).topk(top_k, dim=-1).indices.to(device)
    order, offs = sort_by_expert(ids, num_experts)
    return ids, order, offs


def expert_mlp_fns(E: int, H: int, I: int, device):
    """name -> fn(x_sorted [M, H], offs) running one layer's experts as the engine does: gate_up GEMM, SiLU-and-
    multiply (the same kernel for every variant), down GEMM."""
    from polyrl.rollout.native.moe import Experts, FP8Experts, _silu_mul, grouped_linear

    ex = Experts(E, H, I).to(device=device, dtype=torch.bfloat16 if torch.device(device).type == "cuda"
                             else torch.float32)
    with torch.no_grad():
        ex.gate_up.normal_(0, 0.02)
        ex.down.normal_(0, 0.02)
    def mlp(kind):
        return lambda x, offs: grouped_linear(_silu_mul(grouped_linear(x, ex.gate_up, offs, kind)), ex.down, offs,
                                              kind)

    fns = {"grouped_mm": mlp("grouped_mm"), "loop": mlp("loop")}
    if torch.device(device).type == "cpu" or torch.cuda.get_device_capability(device)[0] == 9:
        fx = FP8Experts(ex)
        fns["scaled_grouped_mm (fp8)"] = lambda x, offs: fx._down(_silu_mul(fx._gate_up(x, offs, None), fp8=True),
                                                                  offs, None)
    return fns, ex


def bench_gemms(bw: float, dev_name: str, rows_out: str | None) -> dict:
    import triton.testing

    s = spec()
    E, H, I, K = s.num_experts, s.hidden_size, s.moe_intermediate_size, s.num_experts_per_tok
    fns, ex = expert_mlp_fns(E, H, I, "cuda")
    layer_bf16 = 3 * E * H * I * 2
    results, best = [], {}
    print(f"\n| regime | tokens | pairs | experts touched | {' | '.join(fns)} | bytes roofline (bf16) |")
    print("|---" * (5 + len(fns)) + "|")
    for regime, sizes in (("decode", DECODE_TOKENS), ("prefill", PREFILL_TOKENS)):
        for T in sizes:
            _, order, offs = routed_pairs(T, E, K, "cuda")
            x = torch.randn(T * K, H, device="cuda", dtype=torch.bfloat16)
            touched = expected_experts_touched(E, K, T)
            roof_us = layer_bf16 * touched / E / bw * 1e6
            row = dict(regime=regime, tokens=T, pairs=T * K, touched=touched, roofline_us=roof_us)
            for name, fn in fns.items():
                try:
                    if name == "loop":  # host-synced: events around eager calls
                        row[name] = triton.testing.do_bench(lambda: fn(x, offs), warmup=5, rep=50) * 1e3
                    else:
                        row[name] = triton.testing.do_bench_cudagraph(lambda: fn(x, offs)) * 1e3
                except Exception as e:  # one kernel failing leaves the others' numbers
                    print(f"{name} at {T} tokens failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    row[name] = float("inf")
            results.append(row)
            for name in fns:
                if name != "loop" or regime == "prefill":
                    best.setdefault(regime, {}).setdefault(name, []).append(row[name])
            print(f"| {regime} | {T} | {T * K} | {touched:.0f} | "
                  + " | ".join(f"{row[n]:.1f} us" for n in fns) + f" | {roof_us:.1f} us |", flush=True)
    # the per-regime winner among the bf16 kernels (FP8 is a separate choice: rollout.quantization; the loop is not
    # a decode candidate: graphs cannot capture its sync)
    table = {regime: min((n for n in times if "fp8" not in n), key=lambda n: sum(times[n]))
             for regime, times in best.items()}
    print(f"\nwinner per regime: {table}  # the sum over each regime's sizes, bf16 kernels ({dev_name})")
    if rows_out:
        from _record import append_row

        for row in results:
            if row["tokens"] in (256, 8192):
                g = row["grouped_mm"]
                append_row(dev_name, f"moe_decode.py --gemms ({row['regime']})",
                           f"Qwen3-30B-A3B experts (gate_up, SiLU-mul, down; one layer), {row['tokens']} tokens x "
                           f"top-8 "
                           f"uniform, {row['touched']:.0f} experts touched; loop {row['loop']:.1f} us"
                           + (f", scaled_grouped_mm (fp8) {row['scaled_grouped_mm (fp8)']:.1f} us"
                              if "scaled_grouped_mm (fp8)" in row else ""),
                           f"_grouped_mm {g:.1f} us", "-", f"{row['roofline_us']:.1f} us (bf16 bytes at "
                           f"{bw / 1e12:.2f} TB/s)", "-", f"{row['roofline_us'] / g:.0%}", rows_out)
    return dict(rows=results, table=table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="fp8kv_w8")
    ap.add_argument("--layers", type=int, default=None, help="cut the 48 layers to N")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--context", type=int, default=2048, help="mean context of a decode step")
    ap.add_argument("--new", type=int, default=128, help="new tokens per row")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gemms", action="store_true", help="the grouped-GEMM comparison instead of the engine run")
    ap.add_argument("--profile", action="store_true", help="after the engine run, a kernel breakdown (torch.profiler)")
    ap.add_argument("--rows-out", default=None, help="append BENCHMARKS.md rows here")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    from rollout import copy_bandwidth

    dev_name = torch.cuda.get_device_name(0)
    bw = copy_bandwidth()
    print(f"device {dev_name}, copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    r = bench_gemms(bw, dev_name, args.rows_out) if args.gemms else run_engine(args, bw, dev_name)
    if args.json_out:
        with open(args.json_out, "a") as f:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
