"""Packed attention forward+backward of one GRPO micro-batch: every row with its own prompt copy (flash varlen, the
unshared layout) vs shared prompts (polyrl/learner/shared_prefix.py: one flash call on gathered K/V). One layer's call,
Qwen2.5-1.5B heads (12 q / 2 kv, head_dim 128), bf16, CUDA.

    PYTHONPATH=. python benchmarks/probes/shared_prompt_attention.py --groups 5 --n 8 --prompt 128 --response 1024

The attention FLOPs barely change (a response still attends to its prompt); what sharing saves is the rest of the
trunk on the duplicate prompt tokens (grpo_step measures that). This checks that the attention itself costs no more.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _record


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=5)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--response", type=int, default=1024)
    ap.add_argument("--rows-out", default=None)
    args = ap.parse_args(argv)
    from triton.testing import do_bench

    from polyrl.learner.packing import _cuda_varlen, _cuda_varlen_kv, _exclusive_cumsum
    from polyrl.learner.shared_prefix import shared_prompt_attention

    G, n, P, R = args.groups, args.n, args.prompt, args.response
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda N, h: torch.randn(N, h, 128, device=dev, generator=g, dtype=torch.bfloat16)  # noqa: E731

    N0 = G * n * (P + R)  # unshared: each row its own prompt copy
    cu0 = _exclusive_cumsum(torch.full((G * n,), P + R, device=dev))
    q0, k0, v0, do0 = rnd(N0, 12), rnd(N0, 2), rnd(N0, 2), rnd(N0, 12)

    N1 = G * P + G * n * R  # shared: [prompts | responses]; a response's keys are its prompt's rows, then its own
    cu1 = _exclusive_cumsum(torch.tensor([P] * G + [R] * (G * n), device=dev))
    cu_kv = _exclusive_cumsum(torch.tensor([P] * G + [P + R] * (G * n), device=dev))
    prompt_rows = torch.arange(G * P, device=dev).view(G, 1, P).expand(G, n, P)
    own_rows = (G * P + torch.arange(G * n * R, device=dev)).view(G, n, R)
    kv_index = torch.cat([torch.arange(G * P, device=dev), torch.cat([prompt_rows, own_rows], -1).flatten()])
    q1, k1, v1, do1 = rnd(N1, 12), rnd(N1, 2), rnd(N1, 2), rnd(N1, 12)

    def step(fn, q, k, v, do):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        return lambda: fn(*leaves).backward(do)

    def attend_shared(q, k, v):
        return shared_prompt_attention(q, k, v, cu1, max(P, R), cu_kv, kv_index, P + R, None, varlen=_cuda_varlen_kv)

    plain = step(lambda q, k, v: _cuda_varlen(q, k, v, cu0, P + R, None), q0, k0, v0, do0)
    shared = step(attend_shared, q1, k1, v1, do1)
    fwd_plain = lambda: _cuda_varlen(q0, k0, v0, cu0, P + R, None)  # noqa: E731
    fwd_shared = lambda: attend_shared(q1, k1, v1)  # noqa: E731
    t = {name: do_bench(fn, warmup=25, rep=200) for name, fn in
         (("plain fwd+bwd", plain), ("shared fwd+bwd", shared), ("plain fwd", fwd_plain), ("shared fwd", fwd_shared))}
    device = torch.cuda.get_device_name()
    print(f"{device}: {G} prompts x {n} samples, prompt {P}, response {R}; tokens {N0} unshared / {N1} shared")
    for k, v in t.items():
        print(f"  {k:16s} {v * 1e3:8.1f} us")
    ratio = t["shared fwd+bwd"] / t["plain fwd+bwd"]
    print(f"  shared / plain (fwd+bwd): {ratio:.2f}")
    if args.rows_out:
        from _record import append_row

        append_row(device, "packed attention fwd+bwd, one layer (us)",
                   f"{G}x{n} rows, prompt {P}, response {R}, 12/2 heads, d 128, bf16; shared prompts (one flash call "
                   f"on gathered K/V) vs flash varlen over unshared rows ({t['plain fwd+bwd'] * 1e3:.0f} us)",
                   f"{t['shared fwd+bwd'] * 1e3:.0f}", peer=f"unshared: {t['plain fwd+bwd'] * 1e3:.0f}",
                   ratio_peer=f"{ratio:.2f}", path=args.rows_out)


if __name__ == "__main__":
    main()
