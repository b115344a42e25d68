"""Paged-decode kernels v1 vs v2 in isolation, bf16 and e4m3 K/V, at long contexts (issue 16). One short GPU call.

    PYTHONPATH=. python benchmarks/probes/decode_kernel.py [--rows-out history] [--budget-s 45]
    TRITON_INTERPRET=1 PYTHONPATH=.:/path/to/triton python benchmarks/probes/decode_kernel.py --smoke
    PYTHONPATH=.:/path/to/triton python benchmarks/probes/decode_kernel.py --sass     # no GPU needed
    PYTHONPATH=. python benchmarks/probes/decode_kernel.py --regimes [bf16] --budget-s 120  # v2 launches by engine regime

Shapes: B = 64 and 128 sequences x 16,384 context tokens, block size 16 (the engine's default), pages in random order
(as a long-running engine hands them out); Qwen-1.5B heads (12 q / 2 kv, head_dim 128) and Llama-8B heads (32 / 8,
128). One attention layer per call. v1 = `paged_decode.py` (one program per kv head), v2 = `paged_decode_v2.py`
(whole pages of several kv heads per program), each with its committed launch config and its own split chooser.

Timing: 20 calls captured in one CUDA graph, replayed 5 times between CUDA events (after a warm-up replay); us per
call = elapsed / 100. No host launch cost is included, as in the engine's captured decode step.
Bytes per call (`bytes_moved`): every context token's K and V rows of every kv head (D bytes in e4m3 or 2D in bf16,
plus one fp32 scale each in e4m3), the block table (4 bytes per page), q read and the output written (bf16). Split-K
partials (a few hundred KB, L2-resident) are not counted. GB/s = bytes / time; the limit is the HBM spec (3.35 TB/s
on an H100 SXM, 4.8 on an H200), and the measured copy bandwidth (read + write of 2 GB) is printed beside it.

After the main grid, a short sweep of v2's e4m3 launch config (cache rows per step, warps, stages) at Qwen B=64 runs
until `--budget-s` seconds have passed since the start; it prints the best, to be committed as CONFIG_FP8 if it wins.
Rows (one per model x batch x dtype: v2 against v1) go to `--rows-out` (default: benchmarks/history.jsonl); on the device
machine pass a file under $OUT and append it here.

`--sass` needs no GPU: it compiles both kernels for sm_90 (Triton's bundled ptxas) and prints, per launch config, the
registers, spill stack, shared memory and the main loop's SASS instruction count per (token, kv head) per warp, with
its shared-memory loads (LDS), conversions (F2FP) and MMAs. Static counts, not time: a guide for an instruction-bound
kernel, and how v2 was designed without a GPU (pointer/stride arguments are assumed 16-divisible, as Triton
specialises them at run time).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the probes
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _record, seed_workloads
from _record import append_row  # noqa: E402

from polyrl.rollout.native import paged_decode as v1  # noqa: E402
from polyrl.rollout.native import paged_decode_v2 as v2  # noqa: E402
from polyrl.rollout.native.attention import FP8, AttnMeta  # noqa: E402

MODELS = {"qwen-1.5b": (12, 2), "llama-8b": (32, 8)}  # q heads, kv heads
D, BS, CTX, BATCHES = 128, 16, 16384, (64, 128)
DEV, ACT = "cuda", torch.bfloat16  # --smoke: "cpu" (Triton's interpreter) and fp16 (its bf16 dot is broken)
HBM_SPEC = {"H100": 3.35e12, "H200": 4.8e12}
KERNELS = {"v1": v1, "v2": v2}


def bytes_moved(batch: int, ctx: int, heads: int, kv_heads: int, fp8: bool) -> int:
    row = D * (1 if fp8 else 2) + (4 if fp8 else 0)  # one (token, kv head) row of K or V, with its scale
    return 2 * batch * ctx * kv_heads * row + batch * (ctx // BS) * 4 + 2 * batch * heads * D * 2


def time_us(fn, calls: int = 20, reps: int = 5) -> float:
    fn()  # compile outside the capture
    if DEV == "cpu":  # --smoke: the script's flow only
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * reps)


def copy_bandwidth() -> float:
    """rollout.py's measurement (eager 1 GiB copies, the median of 10) on a GPU, the one every engine benchmark's
    roofline uses. Until 2026-11-26 this script timed the copies inside a CUDA graph, which on some H100s read 2.43-2.44
    TB/s against 2.95-2.99 from rollout.py on the same machine, so its "% copy BW" column ran high then."""
    if DEV == "cuda":
        from rollout import copy_bandwidth as eager_copy_bandwidth

        return eager_copy_bandwidth()
    x = torch.empty(1 << 20, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    return 2 * x.numel() / (time_us(lambda: y.copy_(x), calls=5, reps=4) / 1e6)


class Cache:
    """Random K/V pages for max(BATCHES) sequences of CTX tokens (block 0 left free, as the engine's scratch block) in
    random page order; bf16 first, then `to_fp8()` replaces them with e4m3 values and per-(token, head) scales."""

    def __init__(self, kv_heads: int, batch: int | None = None, ctx: int | None = None, layers: int = 1,
                 layout: str = "random"):
        b, self.ctx = batch or max(BATCHES), ctx or CTX
        nb = b * self.ctx // BS
        k = torch.randn(nb + 1, BS, kv_heads, D, dtype=ACT, device=DEV)
        v = torch.randn_like(k)
        # random: pages in random order; interleaved: as the engine hands them out when every sequence grows in step
        # (sequence i's page j is block 1 + j * b + i); contiguous: each sequence's pages one run
        order = {"random": lambda: torch.randperm(nb, device=DEV).view(b, -1),
                 "interleaved": lambda: torch.arange(nb, device=DEV).view(-1, b).t(),
                 "contiguous": lambda: torch.arange(nb, device=DEV).view(b, -1)}[layout]()
        self.bt = (order + 1).to(torch.int32).contiguous()
        # (k, v, (k scales, v scales)) per layer: layers > 1 makes that many caches (as an engine's layers), which a
        # timed call cycles through, so a cache smaller than twice the L2 (shape (a)'s 100 MB e4m3) is not partly read
        # from L2 on the next call; the first is the one `k`, `v` and `scales` name
        self.layers = [(k, v, (None, None))] + [(k.clone(), v.clone(), (None, None)) for _ in range(layers - 1)]

    k = property(lambda self: self.layers[0][0])
    v = property(lambda self: self.layers[0][1])
    scales = property(lambda self: self.layers[0][2])

    def to_fp8(self) -> None:
        self.layers = [(k.to(FP8), v.to(FP8), tuple(torch.rand(k.shape[:3], device=DEV) * 0.5 + 0.75 for _ in range(2)))
                       for k, v, _ in self.layers]  # randn fits e4m3's range; scales near 1 keep it so

    def meta(self, batch: int, splits: int) -> AttnMeta:
        return AttnMeta(slot_mapping=None, decode=True, seq_slots=torch.arange(batch, device=DEV),
                        block_tables=self.bt[:batch], context_lens=torch.full((batch,), self.ctx,
                                                                              dtype=torch.int32, device=DEV),
                        num_splits=splits, use_kernel=True)


def run_kernel(name: str, cache: Cache, q: torch.Tensor, sms: int):
    """(us per call, output, splits) of one kernel with its own split choice; None and the error if it fails."""
    mod = KERNELS[name]
    batch, heads, _ = q.shape
    fp8 = cache.scales[0] is not None
    splits = mod.choose_num_splits(batch, cache.k.shape[2], sms, fp8, num_heads=heads)
    meta = cache.meta(batch, splits)
    turn = [0]

    def cycled():  # the next layer's cache each call (captured in turn, so a graph replay cycles too)
        k, v, scales = cache.layers[turn[0] % len(cache.layers)]
        turn[0] += 1
        return mod.paged_decode(q, k, v, meta, D**-0.5, *scales)

    try:
        us = time_us(cycled)
        turn[0] = 0
        return us, cycled(), splits  # the output of the first layer's cache
    except Exception as e:  # a launch config that does not fit: report it, keep going
        return None, f"{type(e).__name__}: {str(e)[:160]}", splits


def sweep(cache: Cache, sms: int, deadline: float) -> None:
    """v2's e4m3 launch configs at Qwen B=64 until the deadline; prints each and the best."""
    q = torch.randn(BATCHES[0], MODELS["qwen-1.5b"][0], D, dtype=ACT, device=DEV)
    committed, best = dict(v2.CONFIG_FP8), (float("inf"), None)
    print(f"\n== v2 e4m3 sweep, qwen-1.5b B={BATCHES[0]} (committed {committed})", flush=True)
    # sm_90 SASS (--sass): rows 256 with 4 warps spills registers, so it is left out
    for rows, warps, stages, pps in [(128, 4, 3, 2), (128, 4, 3, 1), (128, 4, 2, 2), (128, 8, 3, 2), (256, 8, 3, 2),
                                     (128, 4, 3, 4), (64, 4, 3, 2), (256, 8, 2, 1)]:
        if time.time() > deadline:
            print("  (budget reached: sweep stopped)")
            break
        v2.CONFIG_FP8.update(rows=rows, num_warps=warps, num_stages=stages, programs_per_sm=pps)
        us, out, splits = run_kernel("v2", cache, q, sms)
        print(f"  rows {rows} warps {warps} stages {stages} programs/SM {pps} (splits {splits}): "
              + (f"{us:.0f} us" if us else f"failed: {out}"), flush=True)
        if us and us < best[0]:
            best = (us, (rows, warps, stages, pps))
    v2.CONFIG_FP8.clear()
    v2.CONFIG_FP8.update(committed)
    if best[1]:
        print(f"  best rows/warps/stages/programs_per_sm {best[1]}: {best[0]:.0f} us")


# (model, batch, context, split counts to force) for `regime_sweep`: shape (a) (B = 256 at 768 context tokens, its
# mean: rollout.py's 256-token prompts and 1,024 new tokens; 12 whole steps of 64 tokens, and at 784 the same plus a
# masked step of one page, as most of the engine's steps end: the cost of the partial step); s1 at 128 and 64
# sequences and its tail; s2's Llama-8B heads at 128 sequences of ~1-4k context
REGIMES = [("qwen-1.5b", 256, 768, (1, 2, 4)), ("qwen-1.5b", 256, 784, (1,)), ("qwen-1.5b", 128, 16384, (2, 4, 8)),
           ("qwen-1.5b", 64, 16384, (4, 8, 16, 32)), ("qwen-1.5b", 32, 16384, (8, 16, 32, 64)),
           ("qwen-1.5b", 16, 16384, (16, 32, 64, 128)), ("qwen-1.5b", 8, 16384, (32, 64, 128)),
           ("qwen-1.5b", 1, 27648, (128, 256)), ("llama-8b", 128, 2048, (1, 2, 4, 8)),
           ("llama-8b", 32, 4096, (2, 4, 8, 16)), ("llama-8b", 8, 4096, (8, 16, 32, 64))]
# (cache rows per step, warps, stages)
REGIME_CONFIGS = [(128, 4, 3), (64, 4, 3), (32, 1, 3), (64, 1, 3)]  # (128, 4, 3): CONFIG and CONFIG_FP8
# with --regime-batches (a few regimes): more warps per SM, for a regime the four-warp launch fills unsplit (a)
WIDE_CONFIGS = [(256, 8, 3), (128, 8, 3), (64, 2, 3), (128, 4, 2), (128, 4, 4), (64, 4, 4)]


def regime_sweep(sms: int, deadline: float, kv: str = "e4m3", batches: str = "", layers: int = 1,
                 layout: str = "random", sweep_configs: bool = True) -> None:
    """v2's launch configs with forced split counts in the engine's regimes (REGIMES), against the kernel the engine
    runs by default (`decode_kernel=auto`: v2 with its committed launch and split choice, for either cache dtype since
    2026-11-26; v1 for bf16 before), with v1 bf16 for scale. Splits > 1 include the combine launch. us per
    layer; bandwidth as the bytes read over the time (`bytes_moved`). `batches` (comma-separated) keeps those regimes
    only and adds WIDE_CONFIGS. `layers` > 1: each timed call reads the next of that many caches (cold L2, as in the
    engine; 20 calls a graph, so a divisor of 20). `layout`: the block table's page order (`Cache`). `sweep_configs`
    False: the default kernels only."""
    fp8 = kv == "e4m3"
    config = v2.CONFIG_FP8 if fp8 else v2.CONFIG
    committed = dict(config)
    print(f"\n== v2 {kv} regimes (committed {committed}), {layers} layer cache(s) cycled, {layout} page order",
          flush=True)
    keep = {int(b) for b in batches.split(",") if b}
    configs = REGIME_CONFIGS + WIDE_CONFIGS * bool(keep)
    for model, batch, ctx, split_opts in REGIMES:
        if keep and batch not in keep:
            continue
        if time.time() > deadline:
            print("  (budget reached: stopped)")
            break
        heads, kv_heads = MODELS[model]
        cache = Cache(kv_heads, batch, ctx, layers, layout)
        q = torch.randn(batch, heads, D, dtype=ACT, device=DEV)
        bf = run_kernel("v1", cache, q, sms)
        print(f"  {model} B={batch} ctx {ctx}: v1 bf16 {bf[0]:.1f} us "
              f"({bytes_moved(batch, ctx, heads, kv_heads, False) / bf[0] / 1e6:.2f} TB/s, splits {bf[2]})", flush=True)
        nbytes = bytes_moved(batch, ctx, heads, kv_heads, fp8)
        if fp8:
            cache.to_fp8()
        ref = run_kernel("v2", cache, q, sms)  # the default for both cache dtypes since 2026-11-26
        launch = v2.launch_config(batch, kv_heads // v2.heads_per_program(heads, kv_heads), sms, fp8)
        print(f"    {kv} committed (v2): {ref[0]:.1f} us ({nbytes / ref[0] / 1e6:.2f} TB/s, splits {ref[2]}, {launch})",
              flush=True)
        results = []
        for rows, warps, stages in configs * sweep_configs:
            for forced in split_opts:
                config.update(rows=rows, num_warps=warps, num_stages=stages)
                chooser, few = v2.choose_num_splits, v2.FEW_WARPS
                v2.choose_num_splits = lambda *a, n=forced, **k: n  # noqa: E731
                v2.FEW_WARPS = False  # the launch takes CONFIG_FP8 as set here
                try:
                    us, out, _ = run_kernel("v2", cache, q, sms)
                finally:
                    v2.choose_num_splits, v2.FEW_WARPS = chooser, few
                    config.clear()
                    config.update(committed)
                err = ((out.float() - ref[1].float()).norm() / ref[1].float().norm()).item() if us else float("nan")
                label = f"v2 {kv} rows {rows} warps {warps} stages {stages} splits {forced}"
                print(f"    {label}: " + (f"{us:.1f} us ({nbytes / us / 1e6:.2f} TB/s) rel err {err:.1e}" if us
                                          else f"failed: {out}"), flush=True)
                if us:
                    results.append((us, label))
        if results:
            us, label = min(results)
            print(f"  best: {label}: {us:.1f} us ({nbytes / us / 1e6:.2f} TB/s) against the default's {ref[0]:.1f}",
                  flush=True)
        del cache


def sass_report() -> None:
    """Static loop statistics of v1 and v2 compiled for sm_90 on this machine (see the module docstring)."""
    import re
    import subprocess
    import tempfile
    from collections import Counter
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    nvdisasm = Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm"
    cuobjdump = nvdisasm.with_name("cuobjdump")
    ptr = {"Q": "*bf16", "SeqSlots": "*i64", "BT": "*i32", "CL": "*i32", "LSE": "*fp32", "scale": "fp32"}

    def build(fn, consts, fp8, warps, stages):
        kv, sc = ("*fp8e4nv", "*fp32") if fp8 else ("*bf16", "*bf16")
        types = dict(ptr, K=kv, V=kv, KS=sc, VS=sc, O="*fp32", POS="*i64", COS="*fp32", SIN="*fp32",
                     SLOT="*i64", QW="*bf16", KW="*bf16", eps="fp32")  # O: split partials (SPLITS=2); rope unused
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if n not in consts and n not in ("scale", "CL", "eps")}
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))

    def loop_stats(kernel):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            res = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True).stdout
            sass = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True).stdout
        ins, labels = [], {}
        for line in sass.splitlines():
            if m := re.match(r"\s*(\.L_x_\d+):", line):
                labels[m.group(1)] = len(ins)
            elif m := re.match(r"\s+/\*[0-9a-f]+\*/\s+(.*?);", line):
                ins.append(m.group(1))
        back = [(labels[m.group(1)], i) for i, t in enumerate(ins)
                if (m := re.search(r"BRA.*?(\.L_x_\d+)", t)) and labels.get(m.group(1), len(ins)) < i]
        lo, hi = max(back, key=lambda b: b[1] - b[0])  # the main loop: the longest backward branch
        ops = Counter(t.split()[t.startswith("@")].split(".")[0] for t in ins[lo : hi + 1])
        regs, stack = (re.search(rf"{k}:(\d+)", res).group(1) for k in ("REG", "STACK"))
        return hi - lo + 1, ops, regs, stack

    print("| kernel | model | K/V | config | regs | stack | smem KB | loop instr | per token-head | LDS | F2FP "
          "| HMMA |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model, (heads, kv_heads) in MODELS.items():
        group = heads // kv_heads
        for fp8 in (False, True):
            c1 = v1.CONFIG_FP8 if fp8 else v1.CONFIG
            hb = v2.heads_per_program(heads, kv_heads)
            gp = max(16, triton.next_power_of_2(group))
            runs = [("v1", v1._paged_decode_kernel, dict(G=group, GP=gp, TILE=c1["tile"], KVH=kv_heads),
                     c1["num_warps"], c1["num_stages"], c1["tile"])]
            v2_configs = [v2.CONFIG_FP8 if fp8 else v2.CONFIG] + [dict(rows=256, num_warps=8, num_stages=3)] * fp8
            for c2 in v2_configs:
                rows = max(c2["rows"], BS * hb)
                runs.append(("v2", v2._paged_decode_v2_kernel,
                             dict(G=group, HB=hb, R=max(16, triton.next_power_of_2(hb * group)),
                                  PAGES=rows // (BS * hb), KVH=kv_heads, ROPE=False, HAS_NORM=False, PTX=True),
                             c2["num_warps"], c2["num_stages"], rows))
            for name, fn, consts, warps, stages, rows in runs:
                consts = dict(consts, D=D, BS=BS, SPLITS=2, IEEE=False, FP8=fp8)
                kernel = build(fn, consts, fp8, warps, stages)
                n, ops, regs, stack = loop_stats(kernel)
                print(f"| {name} | {model} | {'e4m3' if fp8 else 'bf16'} | rows {rows} warps {warps} stages {stages} | "
                      f"{regs} | {stack} | {kernel.metadata.shared / 1024:.0f} | {n} | {n * warps / rows:.1f} | "
                      f"{ops['LDS']} | {ops['F2FP']} | {ops['HMMA']} |", flush=True)


def _interpreter_scalar_index() -> None:
    """Triton 3.5's interpreter uses a loaded scalar (a 1-element array) as a loop bound through int(array), which
    numpy >= 2.3 refuses (tests/test_paged_decode_v2_interp_on_cpu.py patches the same)."""
    import triton.runtime.interpreter as interp

    patch = interp._patch_lang_tensor

    def patched(tensor):
        patch(tensor)
        tensor.__index__ = lambda self: int(self.handle.data.item())

    interp._patch_lang_tensor = patched


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows-out", default=None, help="JSON-lines file to append result rows to (default: benchmarks/history.jsonl)")
    ap.add_argument("--budget-s", type=float, default=45.0, help="stop the config sweep after this many seconds")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (run with TRITON_INTERPRET=1): checks "
                    "the script's flow, measures nothing")
    ap.add_argument("--sass", action="store_true", help="no GPU: static sm_90 loop statistics of both kernels")
    ap.add_argument("--regimes", nargs="?", const="e4m3", choices=("e4m3", "bf16"), help="only v2's launch configs "
                    "and split counts for this cache dtype in the engine's regimes (REGIMES: shape (a), s1's bulk and "
                    "tail, s2's Llama-8B heads)")
    ap.add_argument("--regime-layers", type=int, default=1, help="with --regimes: cycle each timed call over this "
                    "many caches (4: shape (a)'s 100 MB e4m3 cache is not partly in L2 on the next call)")
    ap.add_argument("--regime-layout", default="random", choices=("random", "interleaved", "contiguous"),
                    help="with --regimes: the block table's page order (interleaved: as the engine hands pages out)")
    ap.add_argument("--regime-default-only", action="store_true", help="with --regimes: time the default kernels "
                    "only, no launch-config sweep")
    ap.add_argument("--regime-batches", default="", help="with --regimes: only the regimes of these batch sizes "
                    "(e.g. 256 for shape (a)), with more launch configs (WIDE_CONFIGS)")
    args = ap.parse_args()
    if args.sass:
        sass_report()
        return
    if args.smoke:  # its numbers measure nothing: no rows for the history unless --rows-out names a file
        args.rows_out = args.rows_out or os.devnull
        global DEV, ACT, CTX, BATCHES
        DEV, ACT, CTX, BATCHES = "cpu", torch.float16, 64, (2, 3)
        _interpreter_scalar_index()
    t0 = time.time()
    dev = torch.cuda.get_device_name() if DEV == "cuda" else "CPU (Triton interpreter, smoke run)"
    sms = torch.cuda.get_device_properties(0).multi_processor_count if DEV == "cuda" else 4
    hbm = next((v for k, v in HBM_SPEC.items() if k in dev), HBM_SPEC["H100"])
    copy_bw = copy_bandwidth()
    print(f"device {dev}, {sms} SMs; HBM spec {hbm / 1e12:.2f} TB/s, measured copy {copy_bw / 1e12:.2f} TB/s",
          flush=True)
    if args.regimes:
        regime_sweep(sms, t0 + args.budget_s, args.regimes, args.regime_batches, args.regime_layers,
                     args.regime_layout, not args.regime_default_only)
        return
    print("| model | B | ctx | K/V | kernel | splits | us/call | GB/s | % HBM spec | % copy BW | v1/v2 "
          "| v2 vs v1 rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    qwen_cache = None
    for model, (heads, kv_heads) in MODELS.items():
        cache = Cache(kv_heads)
        for kv in ("bf16", "e4m3"):
            if kv == "e4m3":
                cache.to_fp8()
            for batch in BATCHES:
                q = torch.randn(batch, heads, D, dtype=ACT, device=DEV)
                nbytes = bytes_moved(batch, CTX, heads, kv_heads, kv == "e4m3")
                res = {name: run_kernel(name, cache, q, sms) for name in KERNELS}
                (us1, o1, _), (us2, o2, _) = res["v1"], res["v2"]
                err = ((o2.float() - o1.float()).norm() / o1.float().norm()).item() if us1 and us2 else float("nan")
                for name, (us, out, splits) in res.items():
                    if us is None:
                        print(f"| {model} | {batch} | {CTX} | {kv} | {name} | {splits} | failed: {out} |")
                        continue
                    ratio = f"{us1 / us2:.2f}x" if name == "v2" and us1 and us2 else "-"
                    print(f"| {model} | {batch} | {CTX} | {kv} | {name} | {splits} | {us:.0f} | "
                          f"{nbytes / us / 1e3:,.0f} | "
                          f"{nbytes / us * 1e6 / hbm:.0%} | {nbytes / us * 1e6 / copy_bw:.0%} | {ratio} | "
                          f"{err if name == 'v2' else 0:.1e} |", flush=True)
                if us1 and us2:
                    floor = nbytes / hbm * 1e6
                    append_row(dev, "decode_kernel.py paged decode v2 vs v1",
                               f"{model} heads {heads}/{kv_heads}x{D}, B={batch} x ctx {CTX}, {kv} K/V, block {BS}, "
                               f"one layer, CUDA graph; splits v1 {res['v1'][2]} v2 {res['v2'][2]}; "
                               f"v2 {nbytes / us2 / 1e3:,.0f} GB/s, v1 {nbytes / us1 / 1e3:,.0f}",
                               f"{us2:.0f} us", f"v1: {us1:.0f} us", f"{floor:.0f} us ({hbm / 1e12:.2f} TB/s HBM)",
                               f"{us1 / us2:.2f}x", f"{floor / us2:.0%} (v1 {floor / us1:.0%})", args.rows_out)
        if model == "qwen-1.5b":
            qwen_cache = cache  # e4m3 now; the sweep reuses it
        del cache
    sweep(qwen_cache, sms, t0 + args.budget_s)
    print(f"\nwall {time.time() - t0:.0f} s; rows appended to {args.rows_out or 'benchmarks/history.jsonl'}")


if __name__ == "__main__":
    main()
