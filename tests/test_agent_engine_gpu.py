"""Multi-turn on the native engine on CUDA (paged prefill kernel for the resumed rows' multi-token chunks, CUDA-graph
decode): each turn's greedy tokens equal a fresh engine's on the whole conversation, and the cached prefix is counted
as saved. The CPU version is tests/test_agent_engine_on_cpu.py."""

import pytest
import torch

from polyrl.rollout.base import SamplingParams
from polyrl.rollout.native import NativeEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_turns_on_kept_kv_match_a_fresh_prefill_on_cuda():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    m = Qwen2ForCausalLM(Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                     tie_word_embeddings=False)).eval()
    kw = dict(dtype=torch.float32, max_num_seqs=16, max_num_batched_tokens=64, gpu_memory_utilization=0.2,
              max_model_len=1024)
    eng, ref = NativeEngine.from_hf(m, **kw), NativeEngine.from_hf(m, **kw)
    g = torch.Generator().manual_seed(1)
    convs = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 40, 17, 90, 3, 33)]
    handles = [None] * len(convs)
    for turn in range(3):
        sp = SamplingParams(n=1, temperature=0.0, max_new_tokens=12, keep_cache=True, continuations=handles)
        out = eng.generate(convs, sp)
        want = ref.generate(convs, SamplingParams(n=1, temperature=0.0, max_new_tokens=12))
        assert out.token_ids == want.token_ids, turn
        for a, b in zip(out.logprobs, want.logprobs):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=2e-3), turn
        if turn:
            assert eng.stats["num_resumed"] == len(convs) and eng.stats["prefill_tokens_saved"] > 0
        handles = out.handles
        tool = [torch.randint(3, 256, (7 + i,), generator=g).tolist() for i in range(len(convs))]
        convs = [c + t + x for c, t, x in zip(convs, out.token_ids, tool)]
    eng.release_kept(handles)
    assert eng.blocks.all_free()
