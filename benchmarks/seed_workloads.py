"""The seeds' generation workloads on one GPU, per GPU, next to the seeds' own numbers and the decode roofline (#16).

    PYTHONPATH=. python benchmarks/seed_workloads.py --shapes s1,a --configs bf16,fp8kv,fp8kv_w8 --seqs 64 --rows-out history
    PYTHONPATH=. python benchmarks/seed_workloads.py --gemms          # per-GEMM bf16 vs FP8 at decode sizes

Shapes (random bf16 weights, no download; forced response lengths, EOS ignored):
  s1  seed 002 (verl + vLLM, DeepSeek-R1-Distill-Qwen-1.5B: Qwen2 1.5B with an untied head): 1,024-token prompts,
      responses with mean 14.2k and max 27.6k (a clipped normal, drawn once with seed 0). The seed generated 512
      sequences on 8 H100s as 4 replicas of TP 2: 7.30M tokens in 260.9 s, so per GPU 64 sequences at 3,497 tok/s.
      `--seqs` picks the sequences per GPU (64 is the seed's work; 128 is twice it).
  s2  seed 001 (NeMo RL, Llama-3.1-8B GRPO, 16 H100s, generation GBS 2,048 so 128 sequences per GPU): 256-token
      prompts (our choice: the seed does not say), responses lognormal with mean ~1,060 and a tail to 3,840 (prompt +
      response <= 4,096). The seed gives no generation-only throughput (its 1,562 tok/s/GPU is the whole step).
  a   rollout.py's (a): Qwen2.5-1.5B, B=256 x 256 prompt tokens x 1,024 new tokens.
Configs: bf16; fp8kv (rollout.kv_cache_dtype=fp8); fp8kv_w8 (+ rollout.quantization=fp8); fp8kv_w8all (every decode
GEMM FP8, not only the large ones); each with a `_v1` or `_v2` suffix runs that paged-decode kernel
(rollout.engine_kwargs.native.decode_kernel; the default `auto` takes v2). add_rmsnorm / silu_mul quantise the FP8
GEMMs' inputs (the row says so). Each (shape, sequences, config) runs in its own
process (`--one-process` runs them all in this one): in a shared process the later configs ran up to 18% slower.
Roofline: every decode step reads the weights once (an untied embedding table is not read: only B rows are gathered;
rollout.py counts it, so its rooflines are ~4% lower at 1.5B) and every running sequence's context K/V (prefill not
counted, but in our time): exact for these shapes, where all sequences run from the first step (max_num_seqs >= sequences).
Bytes are the config's own (e4m3 + scales for FP8) over the copy bandwidth measured in this run; each row also gives
the bf16 roofline, the number the FP8 configs are meant to beat.
Log-prob gap (`--gap`): the engine samples 32 x 256 tokens at temperature 1 on the shape's model; HF's bf16 forward
(the trainer's math) scores the same tokens; we report training/rollout_probs_diff_mean (mean |p_engine - p_train|)
and the mismatch KL estimate mean(log p_engine - log p_train). Random weights give a near-uniform distribution, so
these numbers are a lower bound; the trained-like number comes from `polyrl quickstart --scale gpu` runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _record import append_row  # noqa: E402
from rollout import copy_bandwidth, profile_decode  # noqa: E402

from _clocks import GCClock  # noqa: E402

ARCH = {  # hidden, intermediate, layers, heads, kv heads, vocab, tied
    "r1-distill-1.5b": ("qwen2", 1536, 8960, 28, 12, 2, 151936, False),
    "qwen2.5-1.5b": ("qwen2", 1536, 8960, 28, 12, 2, 151936, True),
    "llama3.1-8b": ("llama", 4096, 14336, 32, 32, 8, 128256, False),
}
SEED_PEER = {"s1": "verl+vLLM (seed 002): 3,497 tok/s/GPU at 64 seqs/GPU", "s2": "NeMo RL (seed 001): no gen-only number",
             "a": "-"}
CONFIGS = {"bf16": {}, "fp8kv": dict(kv_cache_dtype="fp8"), "fp8kv_w8": dict(kv_cache_dtype="fp8", quantization="fp8"),
           # every decode GEMM in FP8, not only those past fp8_linear's size line: the experiment for fused inputs
           "fp8kv_w8all": dict(kv_cache_dtype="fp8", quantization="fp8", fp8_min_elements=0),
           # past 2^24 elements only (the line until 2026-11-26): at 1.5B gate_up alone, down (13.8M) in bf16
           "fp8kv_w8gu": dict(kv_cache_dtype="fp8", quantization="fp8", fp8_min_elements=1 << 24),
           # the recipe engine_kwargs.native.fp8_lm_head=True: the untied LM head in FP8 too
           "fp8kv_w8head": dict(kv_cache_dtype="fp8", quantization="fp8", fp8_lm_head=True)}
CONFIGS.update({f"{name}_{k}": dict(kw, decode_kernel=k) for name, kw in list(CONFIGS.items()) for k in ("v1", "v2")})


def _fp8_inputs(cname: str) -> str:
    """Who quantises the FP8 GEMMs' inputs, for a row with FP8 weights (fp8_linear.FUSED_INPUT)."""
    from polyrl.rollout.native import fp8_linear

    if "w8" not in cname:
        return ""
    return "; FP8 GEMM inputs quantised by add_rmsnorm / silu_mul" if fp8_linear.FUSED_INPUT else \
        "; FP8 GEMM inputs quantised by each GEMM"


def _fused_rope(eng) -> str:
    """Whether the decode kernel does rope_kv's work in its own launch (attention.FUSED_ROPE), and its e4m3 launch
    (paged_decode_v2.FEW_WARPS), for the row."""
    from polyrl.rollout.native import attention, paged_decode_v2

    if eng.decode_kernel != "v2":  # the condition Attention.forward_fused routes on (q/k norms included)
        return ""
    few = (f", one-warp programs at <= {paged_decode_v2.FEW_MAX_SPLITS} splits where four-warp ones would split"
           if eng.kv_fp8 and paged_decode_v2.FEW_WARPS else ", four-warp programs only" if eng.kv_fp8 else "")
    return (" with RoPE and the K/V write" if attention.FUSED_ROPE else " (rope_kv launch kept)") + few


def build_hf(arch: str, max_pos: int):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    kind, h, i, L, nh, kv, V, tied = ARCH[arch]
    common = dict(vocab_size=V, hidden_size=h, intermediate_size=i, num_hidden_layers=L, num_attention_heads=nh,
                  num_key_value_heads=kv, tie_word_embeddings=tied, max_position_embeddings=max_pos,
                  rms_norm_eps=1e-6)
    cfg = Qwen2Config(rope_theta=1e6, **common) if kind == "qwen2" else LlamaConfig(rope_theta=5e5, **common)
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        m = (Qwen2ForCausalLM if kind == "qwen2" else LlamaForCausalLM)(cfg)
    torch.set_default_dtype(old)
    return m.eval()


def workload(shape: str, seqs: int):
    """(arch, prompt length, per-sequence response lengths)."""
    rng = np.random.default_rng(0)
    if shape == "s1":
        lens = np.clip(rng.normal(14200, 6500, seqs), 1500, 27648)
        lens = np.clip(lens * 14200 / lens.mean(), 1500, 27648).astype(int)
        lens[int(np.argmax(lens))] = 27648
        return "r1-distill-1.5b", 1024, lens.tolist()
    if shape == "s2":
        lens = np.clip(rng.lognormal(np.log(800), 0.75, seqs), 64, 3840).astype(int)
        return "llama3.1-8b", 256, lens.tolist()
    return "qwen2.5-1.5b", 256, [1024] * seqs


def _read_per_step(eng) -> list[tuple[str, torch.Tensor]]:
    """The parameters one decode step reads: all but an untied embedding table (only B rows are gathered)."""
    skip = eng.model.embed.weight if eng.model.lm_head is not None else None
    return [(n, p) for n, p in eng.model.named_parameters() if p is not skip]


def engine_bytes(eng) -> tuple[int, int]:
    """(weight bytes read per step, KV bytes per context token) in this engine's dtypes (e4m3 + scales for FP8)."""
    W = sum(p.numel() * p.element_size() for _, p in _read_per_step(eng))
    return W, eng.block_bytes // eng.block_size


def bf16_bytes(eng) -> tuple[int, int]:
    """The same in bf16 (FP8 weight scales dropped): the roofline a bf16 engine cannot beat."""
    s = eng.spec
    W = sum(p.numel() * 2 for n, p in _read_per_step(eng) if not n.endswith("weight_scale"))
    return W, 2 * s.num_layers * s.num_kv_heads * s.head_dim * 2


def roofline(P: int, lens: list[int], W: int, kv_tok: int, bw: float) -> float:
    steps = max(lens)
    ctx = sum(L * P + L * (L + 1) // 2 for L in lens)
    return sum(lens) / ((steps * W + ctx * kv_tok) / bw)


@torch.no_grad()
def logprob_gap(eng, hf, vocab: int) -> dict[str, float]:
    from polyrl.rollout.base import SamplingParams

    prompts = torch.randint(0, vocab, (32, 128), generator=torch.Generator().manual_seed(1)).tolist()
    out = eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=256, ignore_eos=True, seed=3))
    diffs, kls = [], []
    for p, toks, lps in zip(prompts, out.token_ids, out.logprobs):
        ids = torch.tensor([p + toks], device="cuda")
        logits = hf(ids).logits[0, len(p) - 1 : -1].float()
        lp_train = torch.log_softmax(logits, -1).gather(1, ids[0, len(p):, None]).squeeze(1)
        lp_roll = torch.tensor(lps, device="cuda")
        diffs.append((lp_roll.exp() - lp_train.exp()).abs().mean().item())
        kls.append((lp_roll - lp_train).mean().item())
    return {"rollout_probs_diff_mean": float(np.mean(diffs)), "mismatch_kl": float(np.mean(kls))}


def run_shape(shape, seqs, configs, bw, args, dev_name, rows):
    from polyrl.rollout.base import SamplingParams
    from polyrl.rollout.native import NativeEngine

    arch, P, lens = workload(shape, seqs)
    max_len = P + max(lens)
    hf = build_hf(arch, max(4096, max_len))
    vocab = hf.config.vocab_size
    prompts = torch.randint(0, vocab, (seqs, P), generator=torch.Generator().manual_seed(0)).tolist()
    sp = SamplingParams(n=1, temperature=1.0, max_new_tokens=max(lens), ignore_eos=True, seed=0, forced_lengths=lens)
    from polyrl.rollout.native import cuda_graph
    from polyrl.rollout.native import paged_decode as v1
    from polyrl.rollout.native import paged_decode_v2 as v2

    results = []
    for cname, cap in [(c, m) for c in configs for m in args.max_splits]:
        v1.MAX_SPLITS = v2.MAX_SPLITS = cap  # read when the engine captures its decode graphs
        eng = NativeEngine.from_hf(hf, gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=max(256, seqs),
                                   max_model_len=max_len, max_num_batched_tokens=args.max_num_batched_tokens,
                                   **CONFIGS[cname])
        eng.update_weights(hf.state_dict().items())
        W, kv_tok = engine_bytes(eng)
        Wb, kvb = bf16_bytes(eng)
        roof, roof_bf16 = roofline(P, lens, W, kv_tok, bw), roofline(P, lens, Wb, kvb, bw)
        print(f"[{shape} {seqs} {cname} max_splits {cap}] {arch}: weights {W / 1e9:.2f} GB, KV {kv_tok} B/token, cache "
              f"{eng.num_blocks * eng.block_size:,} tokens; roofline {roof:,.0f} tok/s (bf16 {roof_bf16:,.0f})",
              flush=True)
        # warm-up: every batch size the run passes through is captured once here (CAPTURE_AFTER 1), so each size's
        # Triton kernels compile outside the timed run; then the graphs go, and the timed run captures lazily as a
        # rollout does. Until 2026-11-26 the warm-up captured only the sizes it asked for 16 times, and the first
        # process on a fresh machine compiled the rest inside its timed run (s2: 4,610 tok/s, then 6,158 and 6,126
        # in later processes with the same code)
        short = [max(1, L // 32) for L in lens]
        after, cuda_graph.CAPTURE_AFTER = cuda_graph.CAPTURE_AFTER, 1
        eng.generate(prompts, dataclasses.replace(sp, max_new_tokens=max(short), forced_lengths=short))
        torch.cuda.synchronize()
        cuda_graph.CAPTURE_AFTER, eng.graphs = after, None
        gc_clock = GCClock()
        t0 = time.perf_counter()
        out = eng.generate(prompts, sp)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        gc_words = gc_clock.pop()
        gc_clock.close()
        assert out.lengths == lens
        tps = sum(lens) / dt
        r = dict(shape=shape, seqs=seqs, config=cname, max_splits=cap, arch=arch, seconds=dt, tokens_per_s=tps,
                 roofline=roof,
                 roofline_bf16=roof_bf16, frac_roofline=tps / roof, frac_roofline_bf16=tps / roof_bf16,
                 num_preempted=eng.stats["num_preempted"], kv_tokens=eng.num_blocks * eng.block_size,
                 peak_gib=torch.cuda.max_memory_allocated() / 2**30, device=dev_name,
                 mean_len=float(np.mean(lens)), max_len=max(lens), gc=gc_words,
                 decode_gpu_s=eng.stats["decode_gpu_s"], decode_steps=eng.stats["num_decode_steps"],
                 graph_capture_s=eng.stats["graph_capture_s"], prefill_gpu_s=eng.stats["prefill_gpu_s"])
        if args.gap:
            r.update(logprob_gap(eng, hf, vocab))
        if args.kernels:
            profile_decode(eng, vocab, prompts, sp, label=f"[{shape} {seqs} {cname}]", rows=25)
        if args.prefill_kernels:  # the prompts' prefill alone: one new token each
            profile_decode(eng, vocab, prompts, dataclasses.replace(sp, max_new_tokens=1, forced_lengths=None),
                           label=f"[{shape} {seqs} {cname} prefill]", rows=25)
        print(json.dumps(r), flush=True)
        results.append(r)
        peer = SEED_PEER[shape]
        ratio = f"{tps / 3497:.2f}x seed" if shape == "s1" and seqs == 64 else "-"
        gap = (f"; probs_diff {r['rollout_probs_diff_mean']:.1e}, mismatch KL {r['mismatch_kl']:.4f} (random weights)"
               if args.gap else "")
        if args.rows_out:
            rows.append(append_row(
                dev_name, f"seed_workloads.py {shape}",
                f"{arch}, {seqs} seqs/GPU, P{P}, responses mean {np.mean(lens):,.0f} max {max(lens):,}, {cname}; "
                f"{dt:.1f} s, of which decode {r['decode_gpu_s']:.2f} s GPU time "
                f"({r['decode_gpu_s'] / max(r['decode_steps'], 1) * 1e3:.2f} ms a step; CUDA-graph capture "
                f"{r['graph_capture_s']:.2f} s) and the prefill chunks before it {r['prefill_gpu_s']:.2f} s; "
                f"prefill chunk {args.max_num_batched_tokens}; preempted {r['num_preempted']}; "
                f"paged-decode {eng.decode_kernel}{_fused_rope(eng)}, splits <= {cap}; {_small_gemms(eng)}; "
                f"{gc_words} in the timed run"
                f"{_fp8_inputs(cname)}{gap}",
                f"{tps:,.0f} new tok/s", peer, f"roofline {roof:,.0f} ({cname}), bf16 {roof_bf16:,.0f} (copy BW "
                f"{bw / 1e12:.2f} TB/s)", ratio, f"{tps / roof:.0%} ({tps / roof_bf16:.0%} of bf16)", args.rows_out))
        del eng, out
        gc.collect()
        torch.cuda.empty_cache()
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return results


def _small_gemms(eng) -> str:
    """Which kernel runs the FP8 GEMMs of a decode step's few rows (the row's words)."""
    from polyrl.rollout.native import fp8_linear, splitk_fp8

    if not any(getattr(m, "splitk", False) for m in eng.model.modules()):  # engine_kwargs.native.fp8_splitk=False
        return f"w8a16 at <= {fp8_linear.W8A16_MAX_ROWS} rows"
    return (f"split-K FP8 GEMM on e4m3 rows at <= {fp8_linear.SPLITK_MAX_ROWS} rows (and down to 256 / 128 rows "
            "at 1.5B / 8B)"
            f"{' (measured launch table)' if splitk_fp8.TABLE else ''}"
            f"{', down partials summed by add_rmsnorm' if fp8_linear.PARTIALS else ', partials reduced in the launch'}"
            f", w8a16 for bf16 x at <= {fp8_linear.W8A16_MAX_ROWS}")


def bench_gemms(M_list=(1, 8, 16, 32, 48, 64, 128, 256), bw: float | None = None, archs=("r1-distill-1.5b",
                "llama3.1-8b"), sweep_rows=(16, 32, 64), table_out: str | None = None, names=None,
                wide_sweep: bool = False, bmm_splits: tuple = ()) -> None:
    """Each decode GEMM of the 1.5B and 8B shapes in CUDA graphs: bf16 cuBLAS; FP8 W8A8 through `_scaled_mm` (row
    quantisation + GEMM, and the GEMM alone as when add_rmsnorm / silu_mul quantise its input); at <= 64 rows the
    w8a16 kernel (bf16 x; the FP8 path at <= 16 rows before the split-K kernel); at <= splitk_fp8.MAX_ROWS the split-K
    kernel on e4m3 rows, and at `sweep_rows` the best launch config of a sweep (written to `table_out` as JSON,
    which `--splitk-table` loads). Each with the share of copy bandwidth its weight bytes make. `names` picks GEMMs
    (default all four); `wide_sweep` adds 32-row weight tiles, 8 warps and 3 / 5 pipeline stages to the sweep (48
    configs instead of 12). `bmm_splits` adds bf16 split-K through one batched cuBLAS call over K slices (a probe).

    Cold weights, as in the engine: a decode step reads 28+ layers' weights and the K/V between two reads of one
    weight, so none is in L2. Each GEMM runs over enough copies of its weight to fill twice the L2 (a 1.5B qkv is 6 MB
    in bf16 against the H100's 50 MB) and the time is per call. Before 2026-11-26 one weight was timed again and again,
    so the GEMMs under 50 MB read from L2; the 2^24-element FP8 line (fp8_linear.MIN_FP8_ELEMENTS) came from those."""
    import triton

    from polyrl.rollout.native import splitk_fp8, w8a16
    from polyrl.rollout.native.attention import FP8Rows, quantize_fp8_rows
    from polyrl.rollout.native.fp8_linear import FP8Linear, _rows_matmul, _scaled_mm_rowwise

    sweep = [dict(BN=bn, BK=bk, num_warps=4, num_stages=4, programs_per_sm=pps, min_k_steps=2)
             for bn in (64, 128) for bk in (128, 256) for pps in (1, 2, 4)]
    if wide_sweep:
        sweep = [dict(BN=bn, BK=bk, num_warps=w, num_stages=st, programs_per_sm=pps, min_k_steps=2)
                 for bn in (32, 64) for bk in (128, 256) for pps in (1, 2, 4) for w in (4, 8) for st in (3, 5)]
    table = {}
    for arch in archs:
        _, h, inter, _, nh, kv, _, _ = ARCH[arch]
        D = h // nh
        shapes = {"qkv": (h, (nh + 2 * kv) * D), "o": (nh * D, h), "gate_up": (h, 2 * inter), "down": (inter, h)}
        for name, (K, N) in shapes.items():
            if names and name not in names:
                continue
            copies = cold_copies(2 * N * K)
            lins = [torch.nn.Linear(K, N, bias=False, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
            f8s = [FP8Linear(lin) for lin in lins]

            def per_call(fn):
                return per_cold_call(fn, copies)

            for M in M_list:
                x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
                rows = FP8Rows(*quantize_fp8_rows(x))  # quantised by the producer (the default)
                t_bf = per_call(lambda i: lins[i](x))
                t_mm = per_call(lambda i: _scaled_mm_rowwise(x, f8s[i].weight, f8s[i].weight_scale, None,
                                                             torch.bfloat16))
                t_fed = per_call(lambda i: _rows_matmul(rows.q, rows.scale, f8s[i].weight, f8s[i].weight_scale, None,
                                                        torch.bfloat16))

                t_swap = per_call(lambda i: torch._scaled_mm(  # the transposed problem: W x^T, [N, M] out
                    f8s[i].weight, rows.q.t(), scale_a=f8s[i].weight_scale[:, None], scale_b=rows.scale[None, :],
                    out_dtype=torch.bfloat16)) if M % 16 == 0 else float("nan")

                def pct(t, nbytes=N * K):
                    return f"{t:.1f} us ({t_bf / t:.2f}x, {nbytes / t * 1e6 / bw:.0%} BW)"

                line = (f"gemm {arch} {name} M={M} K={K} N={N} ({copies} cold copies): bf16 {pct(t_bf, 2 * N * K)}, "
                        f"w8a8 {pct(t_mm)}, w8a8 fed {pct(t_fed)}, w8a8 fed swapped {pct(t_swap)}")
                if bmm_splits:  # bf16 split-K as one batched cuBLAS call over K slices (strided views, no copy)
                    for sk in (sk for sk in bmm_splits if K % sk == 0):
                        xs = x.view(M, sk, K // sk).transpose(0, 1)
                        ws = [lin.weight.view(N, sk, K // sk).permute(1, 2, 0) for lin in lins]
                        t_part = per_call(lambda i: torch.bmm(xs, ws[i]))
                        t_sum = per_call(lambda i: torch.bmm(xs, ws[i], out_dtype=torch.float32).sum(0))
                        line += (f", bf16 bmm split {sk} {pct(t_part, 2 * N * K)} (+ fp32 partials summed "
                                 f"{pct(t_sum, 2 * N * K)})")
                if M <= w8a16.MAX_ROWS:
                    line += ", w8a16 " + pct(per_call(lambda i: w8a16.w8a16_matmul(
                        x, f8s[i].weight, f8s[i].weight_scale, None, torch.bfloat16)))
                if M <= splitk_fp8.MAX_ROWS:
                    def splitk(c=None):
                        return per_call(lambda i: splitk_fp8.splitk_fp8_matmul(rows, f8s[i].weight,
                                                                               f8s[i].weight_scale, None,
                                                                               torch.bfloat16, c))
                    line += f", splitk fed {pct(splitk())}"
                    if M in sweep_rows:
                        configs = sweep if M <= splitk_fp8.ROW_BLOCK else _wide_row_configs(M)
                        best = min(((_bench_or_inf(lambda: splitk(c)), c) for c in configs), key=lambda tc: tc[0])
                        line += f", best of sweep {pct(best[0])} {best[1]}"
                        table[f"{N},{K},{max(16, triton.next_power_of_2(M))}"] = best[1]
                        if table_out:  # after every sweep: a run cut short keeps what it measured
                            with open(table_out, "w") as f:
                                json.dump(table, f, indent=1)
                print(line, flush=True)


def cold_copies(nbytes: int, at_least: int = 1) -> int:
    """How many copies of a weight of `nbytes` together pass twice the L2, so that a call cycling over them reads its
    weight from HBM, as a decode step does (`per_cold_call`)."""
    return max(at_least, -(-2 * torch.cuda.get_device_properties(0).L2_cache_size // nbytes))


def per_cold_call(fn, copies: int) -> float:
    """Microseconds per call of fn(i), i cycling over `copies` weight copies (cold weights: `cold_copies`), timed as
    one CUDA graph of all the calls."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(lambda: [fn(i) for i in range(copies)]) * 1e3 / copies


def bench_partials(M_list, bw: float, names=("down", "gate_up"), archs=("r1-distill-1.5b",),
                   fast_only: bool = False) -> None:
    """The split-K FP8 kernel returning its partial products (`partials=True`; the consumer sums them, as
    `fused.add_rmsnorm` does) at 16-256 rows of the down / gate_up projections, over tile shapes and forced splits,
    against the in-launch reduction and `_scaled_mm`. Cold weights as in `bench_gemms`. Why: at 256 rows the committed
    64 x 64 tiles make every weight tile read 4 times and every activation tile 24 times from L2 (~110 MB for the
    1.5B down's 13.8 MB weight); whole-row tiles read less, but their split partials were reduced by one program per
    tile. Also the consumer's side: add_rmsnorm over P partials against one tensor. `fast_only`: the `_scaled_mm`
    timings alone (promoted and fast accumulation), no sweep."""
    import triton.testing

    from polyrl.rollout.native import splitk_fp8
    from polyrl.rollout.native.attention import FP8Rows, quantize_fp8_rows
    from polyrl.rollout.native.fp8_linear import FP8Linear, _rows_matmul
    from polyrl.rollout.native.fused import add_rmsnorm

    for arch in archs:
        _, h, inter, _, _, _, _, _ = ARCH[arch]
        for name, (K, N) in {"down": (inter, h), "gate_up": (h, 2 * inter)}.items():
            if name not in names:
                continue
            copies = cold_copies(N * K)
            f8s = [FP8Linear(torch.nn.Linear(K, N, bias=False, dtype=torch.bfloat16, device="cuda"))
                   for _ in range(copies)]

            def per_call(fn):
                return per_cold_call(fn, copies)

            for M in M_list:
                rows = FP8Rows(*quantize_fp8_rows(torch.randn(M, K, dtype=torch.bfloat16, device="cuda")))
                t_fed = per_call(lambda i: _rows_matmul(rows.q, rows.scale, f8s[i].weight, f8s[i].weight_scale, None,
                                                        torch.bfloat16))
                t_fast = per_call(lambda i: _rows_matmul(rows.q, rows.scale, f8s[i].weight, f8s[i].weight_scale,
                                                         None, torch.bfloat16, fast_accum=True))
                if M > splitk_fp8.MAX_ROWS:  # prefill sizes: `_scaled_mm` only, promoted and fast accumulation
                    print(f"partials {arch} {name} M={M} K={K} N={N}: _scaled_mm fed {t_fed:.1f} us, fast accumulation "
                          f"{t_fast:.1f} us ({2 * M * N * K / t_fast / 1e6:.0f} TFLOP/s)", flush=True)
                    continue
                t_sk = per_call(lambda i: splitk_fp8.splitk_fp8_matmul(rows, f8s[i].weight, f8s[i].weight_scale,
                                                                       None, torch.bfloat16))
                print(f"partials {arch} {name} M={M} K={K} N={N}: _scaled_mm fed {t_fed:.1f} us, fast accumulation "
                      f"{t_fast:.1f} us, split-K committed {t_sk:.1f} us (weight floor {N * K / bw * 1e6:.1f} us)",
                      flush=True)
                if fast_only:
                    continue
                p2 = max(16, triton.next_power_of_2(M))
                results = []
                for bm in sorted({min(64, p2), 64, 128, 256}):
                    if bm > max(64, p2):
                        continue
                    for bn in (64, 128):
                        for bk in (128, 256):
                            for w, st in ((4, 4), (8, 3)):
                                if bm * bn > 128 * 128 and w == 4:
                                    continue
                                for split in ((1, 2) if name == "gate_up" else (2, 4, 6, 8, 11)):
                                    c = dict(BN=bn, BK=bk, num_warps=w, num_stages=st, programs_per_sm=1,
                                             min_k_steps=1, BM=bm, split=split)
                                    t = _bench_or_inf(lambda: per_call(lambda i: splitk_fp8.splitk_fp8_matmul(
                                        rows, f8s[i].weight, f8s[i].weight_scale, None, torch.bfloat16, c,
                                        partials=True)))
                                    results.append((t, f"BM {bm} BN {bn} BK {bk} warps {w} stages {st} split {split}"))
                results.sort()
                for t, label in results[:4]:
                    print(f"  partials {label}: {t:.1f} us", flush=True)
                if name == "down":
                    res, wt = torch.randn(M, N, dtype=torch.bfloat16, device="cuda"), torch.ones(N, device="cuda")
                    for p in (1, 2, 4, 8):
                        x = torch.randn(p, M, N, dtype=torch.bfloat16, device="cuda")
                        t = triton.testing.do_bench_cudagraph(lambda: add_rmsnorm(x if p > 1 else x[0], res, wt, 1e-6,
                                                                                  fp8=True)) * 1e3
                        print(f"  add_rmsnorm(fp8 out) over {p} partial(s) of [{M}, {N}]: {t:.1f} us", flush=True)


def _wide_row_configs(M: int) -> list[dict]:
    """Split-K launch configs past 64 rows: row blocks of 64 to all the rows at once (BM 256 reads each weight tile
    once; its [BN, 256] fp32 accumulator wants 8 warps at BN 128)."""
    return [dict(BN=bn, BK=bk, num_warps=w, num_stages=st, programs_per_sm=pps, min_k_steps=2, BM=bm)
            for bm in (64, 128, 256) if bm <= max(64, M) for bn in (64, 128) for bk in (128, 256) for pps in (1, 2)
            for w, st in ((4, 4), (8, 3)) if not (bn == 128 and bk == 256 and bm == 256)]


def _bench_or_inf(fn) -> float:
    """fn() (microseconds); inf for a launch config the GPU cannot run (shared memory, registers)."""
    try:
        return fn()
    except Exception:  # noqa: BLE001  (triton's OutOfResources, or a capture that failed with it)
        torch.cuda.synchronize()
        return float("inf")


def tune_fp8(bw: float) -> None:
    """The paged-decode kernel, bf16 vs e4m3 K/V, over launch configs at a short and a long context."""
    import triton.testing
    from decode_step_parts import random_paged_kv

    from polyrl.rollout.native import paged_decode as pd
    from polyrl.rollout.native.attention import quantize_fp8_rows

    H, KVH, D = 12, 2, 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for B, ctx in ((256, 768), (64, 16384)):
        k, v, meta_of = random_paged_kv(B, ctx)
        k8, ks = quantize_fp8_rows(k)
        v8, vs = quantize_fp8_rows(v)
        q = torch.randn(B, H, D, dtype=torch.bfloat16, device="cuda")
        meta = meta_of(pd.choose_num_splits(B, KVH, sms))
        metas = {pps: meta_of(max(1, min(16, -(-pps * sms // (B * KVH))))) for pps in (1, 2, 4)}
        t_bf = triton.testing.do_bench(lambda: pd.paged_decode(q, k, v, meta, D**-0.5), return_mode="median")
        nbf, n8 = 2 * k[1:].numel() * 2, 2 * (k8[1:].numel() + ks[1:].numel() * 4)
        print(f"decode B={B} ctx={ctx}: bf16 {t_bf * 1e3:.0f} us ({nbf / t_bf / 1e6:,.0f} GB/s; copy-BW floor "
              f"{nbf / bw * 1e6:.0f} us)", flush=True)
        ref = pd.paged_decode(q.float(), (k8.float() * ks[..., None]), (v8.float() * vs[..., None]), meta, D**-0.5)
        out = pd.paged_decode(q, k8, v8, meta, D**-0.5, ks, vs).float()
        print(f"  e4m3 rel err vs dequantised fp32 {((out - ref).norm() / ref.norm()).item():.2e}")
        best = (1e9, None)
        for tile, warps, stages, pps in [(a, b, c, e) for a in (64, 128) for b in (2, 4, 8) for c in (2, 3, 4)
                                         for e in (1, 2, 4)]:
            pd.CONFIG_FP8.update(tile=tile, num_warps=warps, num_stages=stages)
            try:
                ms = triton.testing.do_bench(lambda: pd.paged_decode(q, k8, v8, metas[pps], D**-0.5, ks, vs),
                                             return_mode="median")
            except Exception as e:  # a config that does not fit
                print(f"  fp8 {tile}/{warps}/{stages}/{pps}: {type(e).__name__}: {str(e)[:200]}")
                continue
            if ms < best[0]:
                best = (ms, (tile, warps, stages, pps))
        ms = best[0]
        print(f"  fp8 best tile/warps/stages/programs_per_sm {best[1]}: {ms * 1e3:.0f} us ({n8 / ms / 1e6:,.0f} GB/s; "
              f"{t_bf / ms:.2f}x bf16; floor {n8 / bw * 1e6:.0f} us)", flush=True)


def profile(configs, max_splits: list[int], bw: float, kernels: bool = False) -> None:
    """Decode step time in five regimes of s1's run, from its start to its last sequence: 64 x 8k-token contexts,
    32 x 4k, 8 x 16k, 2 x 24k and 1 x 27k. A regime's step time is the engine's GPU time from its first decode step to
    its last (`stats["decode_gpu_s"]`, CUDA events) over the decode steps, so prefill is not in it (until 2026-11-26 it
    was (generate 256 new tokens - generate 32) / 224 by wall clock, which the long prefills made noisy); it is printed
    with the bytes a step reads (weights + context K/V) and the share of the copy bandwidth that makes. `max_splits` runs each config with those caps on the paged-decode splits (the old cap was 16), so the
    long tail's occupancy shows. `kernels` adds a kernel-time table of each regime's whole run (prefill included)."""
    from polyrl.rollout.base import SamplingParams
    from polyrl.rollout.native import NativeEngine
    from polyrl.rollout.native import paged_decode as v1
    from polyrl.rollout.native import paged_decode_v2 as v2
    from polyrl.rollout.native.cuda_graph import CAPTURE_AFTER

    hf = build_hf("r1-distill-1.5b", 28672)
    gen = torch.Generator().manual_seed(0)
    regimes = {"wide": (64, 8192), "bulk": (32, 4096), "tail": (8, 16384), "end": (2, 24576), "last": (1, 27648)}
    new = 256

    def timed(eng, prompts, n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=n, ignore_eos=True, seed=0))
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for cname in configs:
        for cap in max_splits:
            v1.MAX_SPLITS = v2.MAX_SPLITS = cap  # read when the engine captures its decode graphs
            eng = NativeEngine.from_hf(hf, gpu_memory_utilization=0.6, max_model_len=28672, **CONFIGS[cname])
            W, kv_tok = engine_bytes(eng)
            for regime, (seqs, prompt_len) in regimes.items():
                prompts = torch.randint(0, hf.config.vocab_size, (seqs, prompt_len - new), generator=gen).tolist()
                timed(eng, prompts, CAPTURE_AFTER + 8)  # warm-up: kernels, and this size's graph
                timed(eng, prompts, new)
                step = eng.stats["decode_gpu_s"] / eng.stats["num_decode_steps"]
                nbytes = W + seqs * (prompt_len - new // 2) * kv_tok
                splits = v2.choose_num_splits(seqs, eng.spec.num_kv_heads, eng.num_sms, eng.kv_fp8,
                                              num_heads=eng.spec.num_heads)
                print(f"[{cname} max_splits {cap} {regime} {seqs} x {prompt_len}] decode step {step * 1e3:.3f} ms "
                      f"({seqs / step:,.0f} tok/s), {nbytes / 1e9:.2f} GB/step = {nbytes / step / bw:.0%} of copy BW; "
                      f"v2 splits {splits}", flush=True)
                if kernels:
                    sp = SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=0)
                    profile_decode(eng, hf.config.vocab_size, prompts, sp, label=f"[{cname} {regime}]", rows=14)
            del eng
            gc.collect()
            torch.cuda.empty_cache()
    v1.MAX_SPLITS = v2.MAX_SPLITS = max_splits[-1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="s1,s2,a")
    ap.add_argument("--seqs", default="64", help="sequences per GPU for s1 (comma list); s2 uses 128, a uses 256")
    ap.add_argument("--configs", default="bf16,fp8kv,fp8kv_w8")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.88)
    ap.add_argument("--gap", action="store_true", help="also measure the engine-vs-trainer log-prob gap")
    ap.add_argument("--gemms", action="store_true", help="only the per-GEMM bf16 vs FP8 timing")
    ap.add_argument("--gemm-rows", default="1,8,16,32,48,64,128,256", help="--gemms: row counts")
    ap.add_argument("--gemm-archs", default="r1-distill-1.5b,llama3.1-8b", help="--gemms: model shapes")
    ap.add_argument("--gemm-sweep-rows", default="16,32,64", help="--gemms: rows where the split-K kernel's launch "
                    "configs are swept (empty: none)")
    ap.add_argument("--gemm-bmm-splits", default="", help="--gemms: bf16 split-K through torch.bmm over K slices, "
                    "these split counts (a probe)")
    ap.add_argument("--gemm-names", default=None, help="--gemms: only these of qkv,o,gate_up,down")
    ap.add_argument("--gemm-partials", action="store_true", help="--gemms: only the split-K kernel's partial-product "
                    "mode (the consumer sums them) at --gemm-rows, down and gate_up of --gemm-archs (a probe)")
    ap.add_argument("--gemm-fast-accum", action="store_true", help="--gemms --gemm-partials: only the `_scaled_mm`"
                    " timings, promoted against fast accumulation (no split-K sweep)")
    ap.add_argument("--gemm-wide-sweep", action="store_true", help="--gemms: sweep 48 split-K launch configs, not 12")
    ap.add_argument("--splitk-table-out", default=None, help="--gemms: the sweep's best configs, as JSON")
    ap.add_argument("--splitk-table", default=None, help="load split-K launch configs (--splitk-table-out's JSON)")
    ap.add_argument("--tune-fp8", action="store_true", help="only the decode-kernel launch sweep, bf16 vs e4m3")
    ap.add_argument("--profile", action="store_true", help="only the decode step time in four regimes of s1")
    ap.add_argument("--max-splits", default="256", help="paged-decode split caps to compare (comma list; 16 was the "
                    "cap before 2026-11-25)")
    ap.add_argument("--w8a16-rows", type=int, default=None, help="route decode GEMMs of up to this many rows to the "
                    "w8a16 kernel (fp8_linear.W8A16_MAX_ROWS, 16 by default; the kernel serves up to 64)")
    ap.add_argument("--prefill-kernels", action="store_true",
                    help="after each timed run, a kernel-time table of the prompts' prefill alone (one new token)")
    ap.add_argument("--kernels", action="store_true", help="a kernel-time table of each timed run (with --profile: "
                    "of each regime)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192,
                    help="prefill chunk (rollout.max_num_batched_tokens; 8192 is the default)")
    ap.add_argument("--rows-out", default=None)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--one-process", action="store_true", help="run every shape and config in this process (by "
                    "default each runs in its own: later configs ran slower in a shared one)")
    args = ap.parse_args()
    runs = [(shape, seqs, c) for shape in args.shapes.split(",") for seqs in _seqs(shape, args.seqs)
            for c in args.configs.split(",")]
    if not (args.one_process or args.gemms or args.profile or args.tune_fp8) and len(runs) > 1:
        return _each_in_its_own_process(runs, args)
    args.max_splits = [int(x) for x in args.max_splits.split(",")]
    if args.w8a16_rows is not None:
        from polyrl.rollout.native import fp8_linear, w8a16

        assert 0 <= args.w8a16_rows <= w8a16.MAX_ROWS, f"--w8a16-rows must be 0..{w8a16.MAX_ROWS}"
        fp8_linear.W8A16_MAX_ROWS = args.w8a16_rows  # read at every call
    if args.splitk_table:
        from polyrl.rollout.native import splitk_fp8

        with open(args.splitk_table) as f:
            splitk_fp8.TABLE.update({tuple(int(v) for v in key.split(",")): c for key, c in json.load(f).items()})
    dev_name = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    print(f"device {dev_name}; copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    if args.gemms:
        ints = lambda v: tuple(int(x) for x in v.split(",") if x)  # noqa: E731
        if args.gemm_partials:
            bench_partials(ints(args.gemm_rows), bw,
                           tuple(args.gemm_names.split(",")) if args.gemm_names else ("down", "gate_up"),
                           tuple(args.gemm_archs.split(",")), args.gemm_fast_accum)
            return
        bench_gemms(ints(args.gemm_rows), bw, tuple(args.gemm_archs.split(",")), ints(args.gemm_sweep_rows),
                    args.splitk_table_out, tuple(args.gemm_names.split(",")) if args.gemm_names else None,
                    args.gemm_wide_sweep, ints(args.gemm_bmm_splits))
        return
    if args.profile:
        profile(args.configs.split(","), args.max_splits, bw, args.kernels)
        return
    if args.tune_fp8:
        tune_fp8(bw)
        return
    results, rows = [], []
    for shape in args.shapes.split(","):
        for seqs in _seqs(shape, args.seqs):
            results += run_shape(shape, seqs, args.configs.split(","), bw, args, dev_name, rows)
    _summary(results, args.json_out)


def _seqs(shape: str, seqs: str) -> list[int]:
    """Sequences per GPU: --seqs for s1; s2 runs 128, a runs 256."""
    return [int(x) for x in seqs.split(",")] if shape == "s1" else [128 if shape == "s2" else 256]


def _each_in_its_own_process(runs, args) -> None:
    """Each (shape, sequences, config) in a fresh process, this script again with --one-process. In one process the
    later configs ran slower: s2 fp8kv_w8 as the third config 5,115 tok/s, alone 6,266 (H100, 2026-11-26; the cause,
    likely memory an earlier engine leaves behind, was not measured)."""
    import subprocess
    import tempfile

    results = []
    for shape, seqs, config in runs:
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "run.json")
            subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--shapes", shape, "--seqs",
                            str(seqs), "--configs", config, "--json-out", out, "--one-process"], check=True)
            with open(out) as f:
                results += json.load(f)
    _summary(results, args.json_out)


def _summary(results, json_out) -> None:
    print("\n| shape | seqs | config | max splits | s | new tok/s | roofline | % roofline | % bf16 roofline | vs seed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        vs = f"{r['tokens_per_s'] / 3497:.2f}x" if r["shape"] == "s1" and r["seqs"] == 64 else "-"
        print(f"| {r['shape']} | {r['seqs']} | {r['config']} | {r['max_splits']} | {r['seconds']:.1f} | "
              f"{r['tokens_per_s']:,.0f} | {r['roofline']:,.0f} | {r['frac_roofline']:.0%} | {r['frac_roofline_bf16']:.0%} | {vs} |")
    if json_out:
        with open(json_out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
