"""Where a decode step's time could go down: the paged-attention kernel and the decode GEMMs, measured in isolation.

    PYTHONPATH=. python benchmarks/probes/decode_step_parts.py [--attention] [--gemm] [--autotune]

Shapes are the 1.5B (a) decode step at batch 256 (Qwen2.5-1.5B: 12 q / 2 kv heads, head dim 128, hidden 1536,
MLP 8960). Prints what it measured next to the bandwidth or compute limit; it records nothing (exploration for
`docs/engineering/NOTES_rollout.md`; `rollout.py` is the benchmark of record).
- attention: the committed kernel against variants of the cache layout (token-major [blocks, BS, kvh, D] vs
  head-major [blocks, kvh, BS, D]), block size, block-table order (random vs sequential pages), split count and launch
  config; plus the device's read and copy bandwidth.
- gemm: the decode projections through cuBLAS and cuBLASLt.
- autotune: the same projections through Inductor's max-autotune (Triton templates vs ATen), printing its table.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton.testing

B, H, KVH, D, HID, INTER, VOCAB = 256, 12, 2, 128, 1536, 8960, 151936
GEMMS = {"qkv": (HID, H * D + 2 * KVH * D), "o": (H * D, HID), "gate_up": (HID, 2 * INTER), "down": (INTER, HID),
         "lm_head": (HID, VOCAB)}


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median") / 1e3


def random_paged_kv(b: int, ctx: int, *, bs: int = 16, kvh: int = KVH, head_major: bool = False,
                    sequential: bool = False):
    """Random bf16 K/V pages for `b` sequences of `ctx` tokens (block 0 left free, as the engine's scratch block),
    their block table (random page order unless `sequential`) and a decode-metadata builder taking the split count.
    head_major stores [blocks, kvh, bs, D] and hands the kernel a strided [blocks, bs, kvh, D] view of it."""
    from polyrl.rollout.native.attention import AttnMeta

    nb = b * ctx // bs
    shape = (nb + 1, kvh, bs, D) if head_major else (nb + 1, bs, kvh, D)
    k = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    if head_major:  # the kernel indexes [block, token, head, d] through strides
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    ids = torch.arange(nb, device="cuda") if sequential else torch.randperm(nb, device="cuda")
    bt = (ids + 1).view(b, ctx // bs).to(torch.int32)

    def meta(splits: int) -> AttnMeta:
        return AttnMeta(slot_mapping=None, decode=True, seq_slots=torch.arange(b, device="cuda"), block_tables=bt,
                        context_lens=torch.full((b,), ctx, device="cuda"), num_splits=splits, use_kernel=True)

    return k, v, meta


def bandwidth() -> tuple[float, float]:
    x = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    copy = 2 * x.numel() * 2 / bench(lambda: y.copy_(x))
    read = x.numel() * 2 / bench(lambda: x.sum(dtype=torch.float32))
    return copy, read


def attention(copy_bw: float) -> None:
    from polyrl.rollout.native import paged_decode as pd

    committed = dict(pd.CONFIG)
    q = torch.randn(B, H, D, dtype=torch.bfloat16, device="cuda")
    for ctx in (768, 1280):
        nbytes = 2 * B * ctx * KVH * D * 2
        print(f"\n== attention B={B} ctx={ctx}: KV {nbytes / 1e6:.0f} MB per layer; copy-BW floor "
              f"{nbytes / copy_bw * 1e6:.1f} us")

        def run(name, bs=16, head_major=False, sequential=False, splits=1, **cfg):
            k, v, meta_of = random_paged_kv(B, ctx, bs=bs, head_major=head_major, sequential=sequential)
            meta = meta_of(splits)
            pd.CONFIG.update(committed, **cfg)
            try:
                s = bench(lambda: pd.paged_decode(q, k, v, meta, D**-0.5))
            except Exception as e:  # a launch config that does not fit
                print(f"  {name:48s} failed: {type(e).__name__}: {str(e)[:80]}")
                return
            finally:
                pd.CONFIG.update(committed)
            print(f"  {name:48s} {s * 1e6:6.1f} us  {nbytes / s / 1e12:.2f} TB/s  {nbytes / copy_bw / s:.0%} of copy BW")

        run("committed (token-major, BS16, random pages)")
        run("sequential pages", sequential=True)
        run("head-major BS16", head_major=True)
        run("token-major BS32", bs=32)
        run("head-major BS32", bs=32, head_major=True)
        run("head-major BS64", bs=64, head_major=True)
        run("token-major BS64", bs=64)
        run("splits 2", splits=2)
        for tile, warps, stages in ((64, 4, 4), (64, 8, 3), (128, 4, 2), (128, 8, 2), (32, 4, 4), (32, 2, 4)):
            run(f"tile {tile} warps {warps} stages {stages}", tile=tile, num_warps=warps, num_stages=stages)
        run("head-major BS64 tile 64 warps 4 stages 4", bs=64, head_major=True, num_stages=4)


def sweep(copy_bw: float) -> None:
    """Kernel time (with the split merge) against batch, context and split count: the fixed cost per call, and
    where splitting the context pays (`choose_num_splits`)."""
    from polyrl.rollout.native import paged_decode as pd

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits_list = (1, 2, 4, 8)
    print(f"\n== attention sweep (us), committed config {pd.CONFIG}, splits {splits_list}; * = choose_num_splits")
    for b in (16, 32, 64, 128, 256):
        for ctx in (256, 768, 1280):
            k, v, meta_of = random_paged_kv(b, ctx)
            q = torch.randn(b, H, D, dtype=torch.bfloat16, device="cuda")
            floor = 2 * b * ctx * KVH * D * 2 / copy_bw * 1e6
            chosen = pd.choose_num_splits(b, KVH, sms)
            cells = []
            for splits in splits_list:
                meta = meta_of(splits)
                t = bench(lambda: pd.paged_decode(q, k, v, meta, D**-0.5)) * 1e6
                cells.append(f"{t:5.1f}{'*' if splits == chosen else ' '}")
            print(f"  B={b:3d} ctx={ctx:4d} floor {floor:5.1f}: " + " ".join(cells))


def gemm() -> None:
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        print(f"\n== decode GEMMs at M={B} through {lib}")
        for name, (k, n) in GEMMS.items():
            x = torch.randn(B, k, dtype=torch.bfloat16, device="cuda")
            w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
            s = bench(lambda: F.linear(x, w))
            flop, byts = 2 * B * k * n, 2 * (k * n + B * k + B * n)
            print(f"  {name:8s} [{B}x{k}] @ [{k}x{n}]: {s * 1e6:6.1f} us  {flop / s / 1e12:4.0f} TFLOP/s  "
                  f"{byts / s / 1e12:.2f} TB/s")
    torch.backends.cuda.preferred_blas_library("cublas")


def autotune() -> None:
    import torch._inductor.config as ic

    ic.max_autotune_gemm_backends = "ATEN,TRITON"
    for name in ("qkv", "o", "down", "gate_up"):
        k, n = GEMMS[name]
        x = torch.randn(B, k, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
        f = torch.compile(lambda a, b: F.linear(a, b), mode="max-autotune-no-cudagraphs", dynamic=False)
        f(x, w)
        s_c, s_e = bench(lambda: f(x, w)), bench(lambda: F.linear(x, w))
        print(f"== autotuned {name}: {s_c * 1e6:.1f} us vs eager {s_e * 1e6:.1f} us")
        torch._dynamo.reset()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--attention", action="store_true")
    ap.add_argument("--gemm", action="store_true")
    ap.add_argument("--autotune", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    a = ap.parse_args()
    everything = not (a.attention or a.gemm or a.autotune or a.sweep)
    copy, read = bandwidth()
    print(f"device {torch.cuda.get_device_name()}: copy {copy / 1e12:.2f} TB/s (read+write), "
          f"read (sum) {read / 1e12:.2f} TB/s")
    if a.attention or everything:
        attention(copy)
    if a.sweep or everything:
        sweep(copy)
    if a.gemm or everything:
        gemm()
    if a.autotune or everything:
        autotune()


if __name__ == "__main__":
    main()
