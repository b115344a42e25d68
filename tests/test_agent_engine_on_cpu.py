"""Multi-turn on the native engine (SamplingParams.keep_cache): a trajectory's KV stays cached between its turns, a
turn prefills only its new tokens, and the sampled tokens and log-probs equal those of a fresh prefill of the whole
conversation. Also the agent runner end to end on a scripted tool conversation with a tiny random model."""

import pytest
import torch

from polyrl.rollout.base import SamplingParams
from polyrl.rollout.native import NativeEngine

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny(seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                        tie_word_embeddings=False)).eval()


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def test_turns_continue_on_kept_kv_and_match_a_fresh_prefill():
    """Three turns for 5 trajectories with 'tool tokens' appended between turns; only some trajectories take part in
    the middle call (the others sit in a tool) and keep their cache across it. Every turn's greedy tokens and
    log-probs equal a fresh engine's on the whole conversation; the saved prefill tokens are counted; no block
    leaks after release_kept."""
    m = _tiny()
    eng = NativeEngine.from_hf(m, dtype=torch.float32, max_num_seqs=8, max_num_batched_tokens=32, num_kv_tokens=2048)
    ref = NativeEngine.from_hf(m, dtype=torch.float32, max_num_seqs=8, max_num_batched_tokens=32, num_kv_tokens=2048)
    convs = _prompts([5, 17, 3, 30, 9])
    handles = [None] * 5
    tools = _prompts([4, 7, 1, 12, 6], seed=2)
    stop = (7,)  # a token that stops some rows early, so both stop and length endings are continued
    saved_total = 0
    for turn, active in enumerate([[0, 1, 2, 3, 4], [0, 2, 4], [0, 1, 2, 3, 4]]):
        prompts = [convs[i] for i in active]
        sp = SamplingParams(n=1, temperature=0.0, max_new_tokens=6, stop_token_ids=stop, keep_cache=True,
                            continuations=[handles[i] for i in active])
        out = eng.generate(prompts, sp)
        want = ref.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=6, stop_token_ids=stop))
        assert out.token_ids == want.token_ids, turn
        for a, b in zip(out.logprobs, want.logprobs):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4), turn
        if turn:
            continued = [i for i in active if handles[i] is not None]
            assert eng.stats["num_resumed"] == len(continued)
            # the cached prefix: everything but each row's last sampled token
            assert eng.stats["prefill_tokens_saved"] == sum(len(kept_len[i]) - 1 for i in continued)
            saved_total += eng.stats["prefill_tokens_saved"]
        kept_len = {}
        for k, i in enumerate(active):
            handles[i] = out.handles[k]
            assert handles[i] is not None  # stop and length endings both keep their cache
            convs[i] = convs[i] + out.token_ids[k]
            kept_len[i] = list(convs[i])
            convs[i] = convs[i] + tools[i]  # the tool turn, appended after the sampled tokens
        for i in set(range(5)) - set(active):
            kept_len[i] = list(convs[i][: len(convs[i]) - len(tools[i])])
        assert len(eng.kept) == 5  # the idle trajectories' caches survived the middle call
    assert saved_total > 100
    eng.release_kept(handles)
    assert eng.kept == [] and eng.blocks.all_free()


def test_idle_kept_rows_make_room_when_the_cache_runs_short():
    m = _tiny()
    eng = NativeEngine.from_hf(m, dtype=torch.float32, max_num_seqs=8, max_num_batched_tokens=64, num_kv_tokens=160,
                               block_size=16)
    a = eng.generate(_prompts([40, 40]), SamplingParams(n=1, temperature=0.0, max_new_tokens=8, keep_cache=True))
    assert len(eng.kept) == 2
    big = _prompts([60], seed=3)
    out = eng.generate(big, SamplingParams(n=1, temperature=0.0, max_new_tokens=8, keep_cache=True))
    assert len(out.token_ids[0]) == 8 and len(eng.kept) < 3  # an idle row was let go to fit the new prompt
    eng.release_kept(a.handles + out.handles)
    assert eng.blocks.all_free()
