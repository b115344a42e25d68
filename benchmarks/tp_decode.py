"""Tensor-parallel decode in the native engine (issue 48): tok/s under TP 1 (FP8 weights) / 2 / 4 against the
per-GPU bandwidth roofline, and the all-reduce time against the link, measured in the same run. Run under torchrun,
one process per GPU (TP sizes larger than the job are skipped):

    torchrun --standalone --nproc_per_node=4 benchmarks/tp_decode.py --shape qwen3-32b --tp 1fp8,2,4 \
        --batch 256 --prompt 512 --new 512
    torchrun --standalone --nproc_per_node=4 benchmarks/tp_decode.py --shape llama-70b --tp 4
    torchrun --standalone --nproc_per_node=2 benchmarks/tp_decode.py --shape qwen3-32b --layers 16 --tp 1,2
    torchrun --standalone --nproc_per_node=4 benchmarks/tp_decode.py --shape qwen3-30b-a3b --tp 1,1fp8,2,4

Shapes (random bf16 weights built on the meta device and sharded before any memory is allocated, no download):
  qwen3-32b: 64 layers, hidden 5120, 64 / 8 heads of 128, MLP 25600, vocab 151,936, untied, q/k norms;
  llama-70b (Llama-3.1-70B): 80 layers, hidden 8192, 64 / 8 heads of 128, MLP 28672, vocab 128,256, untied;
  qwen3-30b-a3b (MoE): 48 layers, hidden 2048, 32 / 4 heads of 128, 128 experts of 768 (top-8, norm_topk_prob),
  vocab 151,936, untied, q/k norms; the experts are cut along their intermediate dim under TP (tensor_parallel.py).
  Its random router spreads tokens about evenly over the experts, as a trained, load-balanced one roughly does.
`--layers N` keeps the first N layers (the per-layer numbers do not change; the head's share grows).

What is measured, per TP size (ranks 0..N-1 form the replica; the others wait):
- decode tok/s: B rows x `--new` tokens over the engine's decode GPU time (CUDA events, graphs on, EOS ignored);
- roofline (per GPU): each decode step reads this rank's weights once plus its kv heads' share of every row's KV;
  bytes over the device-to-device copy bandwidth measured here; the ratio is roofline time / decode time. MoE: of
  the experts' bytes only the experts a step routes to count, E (1 - (1 - k/E)^B) of E per layer under even routing
  (B rows, top-k; all 128 from about 64 rows up at Qwen3-30B-A3B);
- all-reduce: 2 per layer per step of [B, hidden] bf16; timed alone in a CUDA graph (2 x layers of them, as a step
  issues them) against the link limit: bus bytes 2 (N-1)/N x B x hidden x 2 over the all-reduce bus bandwidth of a
  256 MB buffer measured in this run (nccl-tests' convention, as benchmarks/nccl_bw.py). The ratio says how close the
  small decode messages get to the link; the share of the decode step they take is printed beside it.
Rows go to BENCHMARKS.md (`--rows-out`), one per TP size, from rank 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from _record import append_row  # noqa: E402

SHAPES = {  # layers, hidden, heads, kv heads, head_dim, intermediate, vocab, model_type
    "qwen3-32b": (64, 5120, 64, 8, 128, 25600, 151936, "qwen3"),
    "llama-70b": (80, 8192, 64, 8, 128, 28672, 128256, "llama"),
    "qwen3-30b-a3b": (48, 2048, 32, 4, 128, 6144, 151936, "qwen3_moe"),
}
MOE = {"qwen3-30b-a3b": dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True)}


def spec_of(name: str, layers: int | None):
    from polyrl.rollout.native.model import ModelSpec

    L, h, nh, kv, hd, inter, V, mt = SHAPES[name]
    L = layers or L
    moe = dict(MOE[name], moe_layers=tuple(range(L))) if name in MOE else {}
    return ModelSpec(model_type=mt, vocab_size=V, hidden_size=h, intermediate_size=inter, num_layers=L,
                     num_heads=nh, num_kv_heads=kv, head_dim=hd, rms_norm_eps=1e-6, qkv_bias=False,
                     qk_norm=mt in ("qwen3", "qwen3_moe"), tie_word_embeddings=False, max_position_embeddings=40960,
                     **moe)


def step_weight_bytes(engine, spec, rows: int) -> float:
    """Bytes of this rank's weights one decode step of `rows` rows reads: all of them for a dense model; for MoE the
    experts' bytes scaled by the expected share of experts routed to under even routing, 1 - (1 - k/E)^rows."""
    from polyrl.rollout.native.moe import moe_layers

    total = engine.weight_bytes()
    if not spec.num_experts:
        return float(total)
    experts = sum(p.numel() * p.element_size() for m in moe_layers(engine.model) for p in m.experts.parameters())
    touched = 1 - (1 - spec.num_experts_per_tok / spec.num_experts) ** rows
    return total - experts * (1 - touched)


@torch.no_grad()
def build_engine(spec, tp, fp8: bool, args):
    """The engine over random weights: meta model -> shard -> allocate (layer by layer, quantised as it goes with
    FP8, so a TP 1 FP8 replica never holds the bf16 model) -> NativeEngine."""
    from types import SimpleNamespace

    from polyrl.rollout.native.engine import NativeEngine
    from polyrl.rollout.native.fp8_linear import quantize_model
    from polyrl.rollout.native.model import CausalLM
    from polyrl.rollout.native.tensor_parallel import shard_model

    dev = torch.device("cuda", torch.cuda.current_device())
    with torch.device("meta"):
        model = CausalLM(spec).to(torch.bfloat16)
    shards = shard_model(model, tp) if tp.size > 1 else None
    g = torch.Generator(device=dev).manual_seed(0)

    def fill(module):
        module.to_empty(device=dev)
        for name, p in module.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)

    fill(model.embed), fill(model.norm), fill(model.lm_head)
    for blk in model.layers:
        fill(blk)
        if fp8:  # the engine's own quantiser, one block at a time
            quantize_model(SimpleNamespace(layers=[blk], embed=model.embed, lm_head=None, spec=spec))
    hd = spec.head_dim
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    max_len = args.prompt + args.new + 16
    model.set_rope(inv_freq, 1.0, max_len, dev)
    return NativeEngine(model, device=dev, gpu_memory_utilization=args.util, max_num_seqs=args.batch,
                        max_num_batched_tokens=args.prefill_tokens, max_model_len=max_len, enforce_eager=False,
                        block_size=16, seed=0, num_kv_tokens=None, kv_cache_dtype=args.kv, quantization=None,
                        shards=shards)


def allreduce_busbw(group, n: int, nbytes: int = 256 << 20, iters: int = 10) -> float:
    """All-reduce bus bandwidth (bytes/s) of a large bf16 buffer over `group`: the link's practical limit."""
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        dist.all_reduce(x, group=group)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x, group=group)
    torch.cuda.synchronize()
    return nbytes * 2 * (n - 1) / n / ((time.perf_counter() - t0) / iters)


def decode_allreduce_s(tp, kind: str, rows: int, hidden: int, count: int, reps: int = 20) -> float:
    """Seconds for `count` all-reduces of [rows, hidden] bf16 (one decode step's), replayed from a CUDA graph as the
    engine's decode graph issues them, through `kind` (nccl, or tensor_parallel.SymmAllReduce's symm_one/two)."""
    from polyrl.rollout.native.tensor_parallel import SymmAllReduce

    x = torch.ones(rows, hidden, dtype=torch.bfloat16, device="cuda")
    if kind == "nccl":
        op = lambda: dist.all_reduce(x, group=tp.group)  # noqa: E731
    else:
        op = lambda s=SymmAllReduce(tp, kind, x.numel()): s(x)  # noqa: E731
    op()  # the communicator / symmetric buffer exist before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(count):
            op()
    graph.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        graph.replay()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / 1e3 / reps


def run_one(args, spec, prompts, sp, tp, fp8: bool, kind: str, bw: float, dev_name: str) -> None:
    """One TP size (and all-reduce kind) on the ranks of `tp`: decode tok/s, roofline, all-reduce against the link."""
    from polyrl.rollout.base import SamplingParams
    from polyrl.rollout.native import tensor_parallel

    n, group, rank = tp.size, tp.group, tp.rank
    if n > 1:
        tensor_parallel.ALLREDUCE = kind  # read by shard_model
    busbw = allreduce_busbw(group, n) if n > 1 else 0.0
    engine = build_engine(spec, tp, fp8, args)
    # warm-up at the full batch: Triton compiles and the decode graph of this size is captured here
    engine.generate(prompts, SamplingParams(n=1, max_new_tokens=8, ignore_eos=True))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.generate(prompts, sp)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    st = engine.stats
    dec_s = st["decode_gpu_s"]
    steps = args.new - 1  # the first new token comes from the prefill
    tok_s = args.batch * steps / dec_s
    kv_tok = engine.block_bytes / engine.block_size  # this rank's KV bytes per token (its kv heads)
    ctx = args.prompt + np.arange(1, args.new)  # context of each decode step
    bytes_read = step_weight_bytes(engine, spec, args.batch) * steps + float(ctx.sum()) * args.batch * kv_tok
    limit_s = bytes_read / bw
    ar_s = ar_limit = 0.0
    if n > 1:
        count = 2 * spec.num_layers
        ar_s = decode_allreduce_s(tp, kind, args.batch, spec.hidden_size, count) * steps
        ar_limit = count * 2 * (n - 1) / n * args.batch * spec.hidden_size * 2 / busbw * steps
    weights_gb = engine.weight_bytes() / 1e9
    del engine
    torch.cuda.empty_cache()
    if rank != 0:
        return
    name = f"TP {n}" + (" FP8 weights" if fp8 else "") + (f", all-reduce {kind}" if n > 1 else "")
    line = (f"{name}: {tok_s:,.0f} tok/s decode ({tok_s / n:,.0f} per GPU), {dec_s:.2f} s decode GPU time, "
            f"{wall:.2f} s wall, at most {st['max_batch']} rows at once; roofline {limit_s:.2f} s = "
            f"{limit_s / dec_s:.0%} ({weights_gb:.1f} GB weights/GPU, KV {kv_tok / 1024:.0f} KiB/token/GPU, "
            f"copy BW {bw / 1e12:.2f} TB/s)")
    if n > 1:
        line += (f"; all-reduce {ar_s:.2f} s alone ({ar_s / dec_s:.0%} of decode) against the link's "
                 f"{ar_limit:.2f} s ({ar_limit / ar_s:.0%}; NCCL bus BW {busbw / 1e9:.0f} GB/s measured)")
    print(line, flush=True)
    cut = f" {args.layers} layers" if args.layers else ""
    shape = (f"{args.shape}{cut}, random weights, B={args.batch} x {args.prompt}+{args.new}, KV {args.kv}, {name}, "
             "CUDA graphs")
    peer = f"all-reduce {ar_s:.2f} s vs link {ar_limit:.2f} s ({busbw / 1e9:.0f} GB/s)" if n > 1 else "-"
    append_row(dev_name, "tp_decode.py decode under tensor parallelism", shape,
               f"{tok_s:,.0f} tok/s ({tok_s / n:,.0f}/GPU)", peer,
               f"{limit_s:.2f} s roofline ({bw / 1e12:.2f} TB/s copy)", "-", f"{limit_s / dec_s:.0%}", args.rows_out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-32b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers")
    ap.add_argument("--tp", default="1fp8,2,4", help="TP sizes; a trailing 'fp8' puts the layer GEMMs in FP8")
    ap.add_argument("--batch", type=int, default=256, help="rows decoded at once")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens per row")
    ap.add_argument("--new", type=int, default=512, help="new tokens per row (EOS ignored)")
    ap.add_argument("--kv", default="auto", help="kv_cache_dtype: auto (bf16) or fp8")
    ap.add_argument("--util", type=float, default=0.9, help="gpu_memory_utilization")
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--allreduce", default="nccl", help="TP > 1: nccl, symm_one, symm_two (comma list: each)")
    ap.add_argument("--rows-out", default=None, help="BENCHMARKS.md path (default: the repo's)")
    args = ap.parse_args()

    from polyrl.rollout.base import SamplingParams
    from polyrl.rollout.native.tensor_parallel import TPGroup

    dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dev_name = f"{torch.cuda.get_device_name()} x{world}"
    from rollout import copy_bandwidth  # the one copy-bandwidth probe every roofline uses

    bw = copy_bandwidth()
    spec = spec_of(args.shape, args.layers)
    ids = torch.randint(0, spec.vocab_size, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
    prompts = ids.tolist()
    sp = SamplingParams(n=1, temperature=1.0, max_new_tokens=args.new, ignore_eos=True, seed=0)
    for item in args.tp.split(","):
        fp8 = item.endswith("fp8")
        n = int(item.removesuffix("fp8"))
        if n > world:
            if rank == 0:
                print(f"TP {n}: skipped ({world} processes)", flush=True)
            continue
        # every rank takes part in new_group; ranks >= n sit this size out
        group = dist.new_group(list(range(n))) if n > 1 else None
        for kind in (args.allreduce.split(",") if n > 1 else ["-"]):
            if rank < n:
                run_one(args, spec, prompts, sp, TPGroup(rank=rank, size=n, group=group, src=0), fp8, kind, bw,
                        dev_name)
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
