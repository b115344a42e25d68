"""Reward-model throughput on one GPU: a Qwen2.5-7B-shaped classifier scoring, and a 7B judge decoding.

    python benchmarks/reward_model.py --rows-out BENCHMARKS.md --json-out /tmp/rm.json
    python benchmarks/reward_model.py --tiny      # a CPU smoke run of the same code (no numbers worth keeping)
    bash benchmarks/reward_model_step.sh          # 2 GPUs: whole GRPO step, the RM colocated vs on its own GPU

1. Scoring (polyrl/rewards/reward_model.py `DiscriminativeRM.score_ids`): random-weight Qwen2ForSequenceClassification
   of Qwen2.5-7B's shape in bf16, 512 sequences with lognormal lengths (median 1024, 64-4096 tokens; a batch of
   prompt + response pairs), cut by polyrl's padded-token budget (`--max-tokens`, sorted by length). Reported as
   real tokens/s, against
   - the compute limit: forward FLOPs (2 x matmul weights x tokens + the full attention square, learner/flops.py's
     convention divided by 3 for forward only) over the dense bf16 peak (989 TFLOP/s on H100/H200);
   - a plain HF forward: the model's own `forward` (logits at every position, pooled at the last non-pad token) over
     fixed `--hf-micro`-row micro-batches in arrival order, what verl's legacy worker does without remove-padding.
   Both paths' scores are compared (max |difference| printed) so the speed is of the same numbers.
2. Judge decode (polyrl/rewards/judge.py's engine, `NativeEngine`): random-weight Qwen2.5-7B causal LM, 256 judge
   prompts of 512 tokens, 32 greedy verdict tokens each (`ignore_eos`), against HF `generate` on the same batch
   (before the engine reserves its KV cache) and against a roofline: prefill FLOPs over the bf16 peak plus, per
   decode step, the weights and the KV cache read once over the measured copy bandwidth.
Each appends a BENCHMARKS.md row with `--rows-out` (benchmarks/_record.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rope_theta=1e6,
                 rms_norm_eps=1e-6)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1000, max_position_embeddings=4096)


def build(cls_name: str, shape: dict, device: str, dtype: torch.dtype, **kw):
    import transformers

    cfg = transformers.Qwen2Config(**shape, pad_token_id=0, **kw)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = getattr(transformers, cls_name)(cfg).eval()
    finally:
        torch.set_default_dtype(prev)
    return model


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def forward_flops(cfg, lengths: list[int]) -> float:
    from polyrl.learner.flops import training_flops

    return training_flops(cfg, lengths, lm_head_tokens=0) / 3  # forward = a third of forward + backward


@torch.no_grad()
def hf_forward_scores(model, seqs: list[list[int]], micro: int, device: str) -> list[float]:
    out = []
    for i in range(0, len(seqs), micro):
        batch = seqs[i : i + micro]
        T = max(map(len, batch))
        ids = torch.zeros(len(batch), T, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, s in enumerate(batch):
            ids[j, : len(s)], mask[j, : len(s)] = torch.tensor(s), 1
        out += model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[:, -1].float().tolist()
    return out


def timed(fn, device: str):
    sync(device)
    t0 = time.perf_counter()
    result = fn()
    sync(device)
    return result, time.perf_counter() - t0


def bench_scoring(args, device: str, dtype, peak: float, rows: list, report: dict, dev_name: str) -> None:
    from polyrl.rewards.reward_model import DiscriminativeRM

    shape = TINY if args.tiny else QWEN25_7B
    model = build("Qwen2ForSequenceClassification", shape, device, dtype, num_labels=1)
    rng = np.random.default_rng(0)
    n = 32 if args.tiny else args.num_seqs
    lengths = np.clip(rng.lognormal(np.log(args.median_len), 0.5, n), 64, 4096).astype(int).tolist()
    seqs = [rng.integers(1, shape["vocab_size"], L).tolist() for L in lengths]
    rm = DiscriminativeRM(model, None, device=torch.device(device), max_tokens=args.max_tokens, max_rows=1024,
                          sleep=False)
    rm.score_ids(seqs[:8])  # warm-up (kernels, allocator)
    hf_forward_scores(model, seqs[:8], args.hf_micro, device)
    for _ in range(args.repeats):
        ours, dt = timed(lambda: rm.score_ids(seqs), device)
    hf = None
    if not args.no_hf:
        for _ in range(args.repeats):
            hf, hf_dt = timed(lambda: hf_forward_scores(model, seqs, args.hf_micro, device), device)
    tokens = sum(lengths)
    tps = tokens / dt
    flops = forward_flops(model.config, lengths)
    limit = tokens / (flops / peak) if peak else None
    hf_tps = tokens / hf_dt if hf is not None else None
    diff = max(abs(a - b) for a, b in zip(ours, hf)) if hf is not None else None
    r = dict(benchmark="scoring", tokens=tokens, seconds=dt, tokens_per_s=tps, limit_tokens_per_s=limit,
             frac_limit=tps / limit if limit else None, hf_tokens_per_s=hf_tps,
             speedup_vs_hf=tps / hf_tps if hf_tps else None,
             max_abs_score_diff_vs_hf=diff, tflops=flops / dt / 1e12, device=dev_name)
    report["scoring"] = r
    print(json.dumps(r), flush=True)
    desc = (f"{'tiny' if args.tiny else 'Qwen2.5-7B'}-shape classifier, bf16, {n} seqs lognormal median "
            f"{args.median_len} (64-4096, {tokens:,} tokens), token budget {args.max_tokens}; |score - HF| <= "
            f"{diff if diff is None else f'{diff:.3g}'}")
    rows.append(dict(benchmark="reward_model.py scoring tok/s", shape=desc, polyrl=f"{tps:,.0f} tok/s",
                     peer=(f"HF forward, fixed {args.hf_micro}-row micro-batches: {hf_tps:,.0f} tok/s" if hf_tps
                           else "-"),
                     limit=f"{limit:,.0f} tok/s (forward FLOPs / {peak / 1e12:.0f} TFLOP/s)" if limit else "-",
                     ratio_peer=f"{tps / hf_tps:.2f}x" if hf_tps else "-",
                     ratio_limit=f"{tps / limit:.0%}" if limit else "-"))


def bench_judge(args, device: str, dtype, peak: float, rows: list, report: dict, dev_name: str) -> None:
    from transformers import GenerationConfig

    from polyrl.rollout.base import SamplingParams
    from polyrl.rollout.native import NativeEngine

    shape = TINY if args.tiny else QWEN25_7B
    hf = build("Qwen2ForCausalLM", shape, device, dtype)
    B, P, N = (8, 32, 4) if args.tiny else (args.judge_prompts, args.judge_prompt_len, args.judge_new)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, shape["vocab_size"], (B, P), generator=g)
    hf_tps = None
    if not args.no_hf:  # before the engine reserves its KV cache, so HF has the whole GPU
        gcfg = GenerationConfig(do_sample=False, max_new_tokens=N, min_new_tokens=N, eos_token_id=None, pad_token_id=0)
        ids = prompts.to(device)
        hf.generate(ids[:, :16], attention_mask=torch.ones_like(ids[:, :16]),
                    generation_config=GenerationConfig(do_sample=False, max_new_tokens=2, min_new_tokens=2,
                                                       eos_token_id=None, pad_token_id=0))
        out, hf_dt = timed(lambda: hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gcfg),
                           device)
        assert out.shape[1] == P + N
        hf_tps = B * N / hf_dt
        del out
        if device == "cuda":
            torch.cuda.empty_cache()
    eng = NativeEngine.from_hf(hf, device=device, dtype=dtype, gpu_memory_utilization=args.gpu_memory_utilization,
                               max_num_seqs=max(B, 1), max_model_len=P + N + 16)
    sp = SamplingParams(n=1, temperature=0.0, max_new_tokens=N, ignore_eos=True)
    eng.generate(prompts[:, : P // 2].tolist(), sp)  # warm-up: graphs of the batch sizes this run passes through
    gen, dt = timed(lambda: eng.generate(prompts.tolist(), sp), device)
    assert all(x == N for x in gen.lengths)
    tps = B * N / dt
    roof = None
    if device == "cuda":
        from polyrl.learner.flops import matmul_params

        trunk, head = matmul_params(hf.config)
        W = eng.weight_bytes()
        s = eng.spec
        kvpt = 2 * s.num_layers * s.num_kv_heads * s.head_dim * 2
        from rollout import copy_bandwidth  # the one copy-bandwidth probe every roofline uses

        bw = copy_bandwidth()
        t_min = 2 * (trunk * B * P + head * B) / peak + sum(W + B * (P + i) * kvpt for i in range(N)) / bw
        roof = B * N / t_min
    r = dict(benchmark="judge", prompts=B, prompt_len=P, new_tokens=N, seconds=dt, tokens_per_s=tps,
             hf_tokens_per_s=hf_tps, speedup_vs_hf=tps / hf_tps if hf_tps else None, roofline_tokens_per_s=roof,
             frac_roofline=tps / roof if roof else None, device=dev_name)
    report["judge"] = r
    print(json.dumps(r), flush=True)
    desc = (f"{'tiny' if args.tiny else 'Qwen2.5-7B'}-shape judge, bf16, {B} prompts x {P} tokens, {N} greedy "
            "verdict tokens each (ignore_eos), native engine")
    rows.append(dict(benchmark="reward_model.py judge verdict tok/s", shape=desc, polyrl=f"{tps:,.0f} tok/s",
                     peer=f"HF generate, same batch: {hf_tps:,.0f} tok/s" if hf_tps else "-",
                     limit=(f"{roof:,.0f} tok/s (prefill at bf16 peak + weights/KV per step at copy BW)" if roof
                            else "-"),
                     ratio_peer=f"{tps / hf_tps:.2f}x" if hf_tps else "-",
                     ratio_limit=f"{tps / roof:.0%}" if roof else "-"))


def save_models(out: Path, policy_shape: str) -> None:
    """Random-weight HF directories with the char tokenizer (its chat template) for whole-step runs
    (benchmarks/reward_model_step.sh): `policy` (a Qwen2.5 causal LM of `policy_shape`), `rm` (a Qwen2.5-7B-shaped
    classifier) and verl-schema data of the synthetic reverse task."""
    from polyrl.data.dataset import write_parquet
    from polyrl.data.synthetic import make_rows
    from polyrl.models.tiny import build_char_tokenizer

    shapes = {"0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                           num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                           rms_norm_eps=1e-6, tie_word_embeddings=True),
              "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                           num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                           rms_norm_eps=1e-6, tie_word_embeddings=True), "tiny": TINY}
    tok = build_char_tokenizer()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name, cls, shape, kw in (("policy", "Qwen2ForCausalLM", shapes[policy_shape], {}),
                                 ("rm", "Qwen2ForSequenceClassification", TINY if policy_shape == "tiny" else QWEN25_7B,
                                  {"num_labels": 1})):
        model = build(cls, shape, device, torch.bfloat16, **kw)
        model.config.eos_token_id = tok.eos_token_id
        model.config.pad_token_id = tok.pad_token_id
        model.save_pretrained(out / name)
        tok.save_pretrained(out / name)
        del model
    write_parquet(make_rows("reverse", 2048, seed=1, split="train"), out / "data" / "train.parquet")
    print(f"wrote {out}/policy, {out}/rm, {out}/data/train.parquet", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--save-models", default=None, help="only write random policy/RM dirs here (for the step runs)")
    ap.add_argument("--policy-shape", default="1.5b", choices=["tiny", "0.5b", "1.5b"])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run)")
    ap.add_argument("--parts", default="scoring,judge")
    ap.add_argument("--num-seqs", type=int, default=512)
    ap.add_argument("--median-len", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=16384, help="polyrl's padded tokens per forward")
    ap.add_argument("--hf-micro", type=int, default=16, help="rows per plain HF forward")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs; the last is reported")
    ap.add_argument("--judge-prompts", type=int, default=256)
    ap.add_argument("--judge-prompt-len", type=int, default=512)
    ap.add_argument("--judge-new", type=int, default=32)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--rows-out", default=None, help="append BENCHMARKS.md rows here")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()

    if args.save_models:
        return save_models(Path(args.save_models), args.policy_shape)
    from polyrl.learner.flops import peak_flops

    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    dev_name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    peak = peak_flops() if device == "cuda" else 0.0
    print(f"device {dev_name}; bf16 peak {peak / 1e12:.0f} TFLOP/s", flush=True)
    rows, report = [], {}
    torch.manual_seed(0)
    with torch.no_grad():
        if "scoring" in args.parts:
            bench_scoring(args, device, dtype, peak, rows, report, dev_name)
            gc.collect()  # the classifier's 15 GB go before the judge is built
            if device == "cuda":
                torch.cuda.empty_cache()
        if "judge" in args.parts:
            bench_judge(args, device, dtype, peak, rows, report, dev_name)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))
    for r in rows:
        print(f"{r['benchmark']}: {r['polyrl']} | peer {r['peer']} ({r['ratio_peer']}) | limit {r['limit']} "
              f"({r['ratio_limit']}) | {r['shape']}")
        if args.rows_out:
            from _record import append_row

            append_row(dev_name, r["benchmark"], r["shape"], r["polyrl"], peer=r["peer"], limit=r["limit"],
                       ratio_peer=r["ratio_peer"], ratio_limit=r["ratio_limit"], path=args.rows_out)


if __name__ == "__main__":
    main()
