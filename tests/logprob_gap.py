"""Shared by the GPU tests that check a decode-path change against HF: a model with the 1.5B MLP shape, and the mean
gap between the engine's sampled-token log-probs and HF's recomputation of the same sequences."""

import torch


def mlp15b_model():
    """Two Qwen2 layers with DeepSeek-R1-Distill-Qwen-1.5B's widths (hidden 1536, MLP 8960, 12 / 2 heads) and a
    512-token vocabulary, bf16 on CUDA: the shapes the decode path's measured GEMM rules (sliced down, FP8 partials)
    are keyed on."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=1536, intermediate_size=8960, num_hidden_layers=2,
                      num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).to("cuda", torch.bfloat16).eval()


@torch.no_grad()
def hf_logprob_gap(hf_model, prompts, out) -> float:
    """Mean |HF log-prob - engine log-prob| over every generated token of `out` (a rollout of `prompts`)."""
    diffs = []
    for r, toks in enumerate(out.token_ids):
        p = prompts[r]
        logits = hf_model(torch.tensor([p + toks], device="cuda")).logits[0, len(p) - 1 : -1].float()
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(toks, device="cuda")[:, None]).squeeze(1)
        diffs.append((ref - torch.tensor(out.logprobs[r], device="cuda")).abs())
    return torch.cat(diffs).mean().item()
