"""Native rollout engine on CPU (CI): exactness against HF, scheduling bookkeeping, sampling statistics.

Tolerances: fp32 greedy tokens equal HF `generate` exactly; fp32 logprobs within 1e-4 of HF's log_softmax on the same
tokens; sampling frequencies within 0.02 of the target probabilities (20k draws, ~5 sigma).
"""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from polyrl.rollout.base import ROLLOUT_BACKENDS, SamplingParams  # noqa: E402
from polyrl.rollout.native import NativeEngine  # noqa: E402
from polyrl.rollout.native.block_manager import BlockManager  # noqa: E402
from polyrl.rollout.token_sampling import sample  # noqa: E402
from polyrl.rollout.native.scheduler import Scheduler, Sequence  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny(kind="qwen2", seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512)
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=False, **common)).eval()  # tied random models echo
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(head_dim=16, tie_word_embeddings=True, **common)).eval()
    return LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **common)).eval()


def _prompts(lengths, seed=1, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _hf_greedy(m, prompt, n):
    from transformers import GenerationConfig

    gc = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        return m.generate(torch.tensor([prompt]), generation_config=gc)[0, len(prompt):].tolist()


def _hf_logprobs(m, prompt, toks, temperature=1.0):
    with torch.no_grad():
        logits = m(torch.tensor([prompt + toks])).logits[0, len(prompt) - 1 : -1] / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(toks)[:, None]).squeeze(1)


@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3"])
def test_greedy_equals_hf_with_chunking_sharing_and_continuous_batching(kind):
    m = _tiny(kind)
    eng = NativeEngine.from_hf(m, dtype=torch.float32, max_num_seqs=3, max_num_batched_tokens=16, num_kv_tokens=1024)
    prompts = _prompts([3, 21, 1, 9, 40])
    out = eng.generate(prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=10))
    assert out.prompt_index == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    for i, p in enumerate(prompts):
        ref = _hf_greedy(m, p, 10)
        assert out.token_ids[2 * i] == ref and out.token_ids[2 * i + 1] == ref, i
        diff = (_hf_logprobs(m, p, ref) - torch.tensor(out.logprobs[2 * i])).abs().max().item()
        assert diff < 1e-4, diff
    assert out.finish_reason == ["length"] * 10
    assert eng.stats["max_batch"] <= 3
    assert eng.blocks.all_free()
    # a prompt is prefilled once for its n samples (chunked prefill over several steps for the 40-token one)
    assert eng.stats["prefill_tokens"] == sum(map(len, prompts))


def test_stop_tokens_and_ignore_eos():
    m = _tiny()
    eng = NativeEngine.from_hf(m, dtype=torch.float32, num_kv_tokens=1024)
    p = _prompts([7])
    ref = _hf_greedy(m, p[0], 12)
    stop = ref[4]
    cut = ref.index(stop) + 1
    out = eng.generate(p, SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(stop,)))
    assert out.token_ids[0] == ref[:cut] and out.finish_reason == ["stop"] and len(out.logprobs[0]) == cut
    out = eng.generate(p, SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(stop,), ignore_eos=True))
    assert out.token_ids[0] == ref and out.finish_reason == ["length"]


def test_forced_lengths_continuous_batching_beats_static_batches():
    m = _tiny()
    eng = NativeEngine.from_hf(m, dtype=torch.float32, max_num_seqs=2, num_kv_tokens=1024)
    lengths = [1, 9, 2, 3, 7, 4]
    out = eng.generate(_prompts([5] * 6), SamplingParams(temperature=1.0, max_new_tokens=9, forced_lengths=lengths))
    assert out.lengths == lengths and all(len(lp) == n for lp, n in zip(out.logprobs, lengths))
    static = 9 + 3 + 7  # batches of 2 in order, each decoding until its longest member is done
    assert eng.stats["max_batch"] <= 2 and eng.stats["num_decode_steps"] < static - 1
    assert eng.blocks.all_free()


def test_preemption_when_blocks_run_out_keeps_outputs_exact():
    m = _tiny()
    prompts = _prompts([20, 30, 25, 18])
    eng = NativeEngine.from_hf(m, dtype=torch.float32, num_kv_tokens=80, block_size=4)
    out = eng.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=24))
    assert eng.stats["num_preempted"] > 0
    for i, p in enumerate(prompts):
        assert out.token_ids[i] == _hf_greedy(m, p, 24), i
    assert eng.blocks.all_free()


def test_prompt_blocks_are_shared_with_refcount_n():
    bm = BlockManager(num_blocks=32, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_blocks_per_seq=16, forced_max_new=lambda r: 5)
    parent = Sequence(row=0, prompt_index=0, tokens=list(range(10)), num_prompt=10, max_new=5, n=3)
    sched.waiting.append(parent)
    step = sched.schedule()
    assert not step.decode and step.chunks == [(0, 10)]
    assert len(step.sample_seqs) == 3 and step.sample_src == [0, 0, 0]
    full = parent.blocks[:2]
    assert [bm.ref[b] for b in full] == [3, 3]  # 2 full prompt blocks shared by the 3 samples
    partial = parent.blocks[2]
    assert sorted(s for s, _ in step.copies) == [partial, partial] and bm.ref[partial] == 1
    children = step.sample_seqs[1:]
    assert all(c.blocks[:2] == full and c.blocks[2] != partial for c in children)
    assert bm.num_free == 31 - 5  # 3 prompt blocks + 2 private copies
    for s in step.sample_seqs:
        sched.retire(s)
    assert bm.all_free()


def test_sampler_statistics():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0]]).repeat(20000, 1)
    g = torch.Generator().manual_seed(0)
    for T in (0.5, 1.0, 2.0):
        tok, lp = sample(logits, T, generator=g)
        freq = torch.bincount(tok, minlength=6).float() / len(tok)
        assert (freq - torch.softmax(logits[0] / T, -1)).abs().max() < 0.02, T
        assert torch.allclose(lp, torch.log_softmax(logits / T, -1).gather(1, tok[:, None]).squeeze(1))
    tok, _ = sample(logits, 1.0, top_k=3, generator=g)
    assert set(tok.tolist()) == {0, 1, 2}
    freq = torch.bincount(tok, minlength=6).float() / len(tok)
    assert (freq[:3] - torch.softmax(logits[0, :3], -1)).abs().max() < 0.02
    p = torch.softmax(logits[0], -1)  # top-p=0.6: the smallest prefix with mass >= 0.6
    k = int((torch.cumsum(p, 0) < 0.6).sum()) + 1
    tok, _ = sample(logits, 1.0, top_p=0.6, generator=g)
    assert set(tok.tolist()) == set(range(k))
    tok, lp = sample(logits[:3], 0.0)
    assert tok.tolist() == [0, 0, 0] and torch.allclose(lp, torch.log_softmax(logits[:3], -1)[:, 0])


def test_seeded_sampling_is_reproducible_and_logprobs_are_temperature_scaled():
    m = _tiny()
    eng = NativeEngine.from_hf(m, dtype=torch.float32, num_kv_tokens=1024)
    prompts = _prompts([4, 9])
    sp = SamplingParams(n=3, temperature=0.7, top_k=50, max_new_tokens=8, seed=7)
    a, b = eng.generate(prompts, sp), eng.generate(prompts, sp)
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    c = eng.generate(prompts, SamplingParams(n=3, temperature=0.7, top_k=50, max_new_tokens=8, seed=8))
    assert c.token_ids != a.token_ids
    assert len({tuple(t) for t in a.token_ids[:3]}) > 1  # the n samples of one prompt differ
    for r, toks in enumerate(a.token_ids):
        ref = _hf_logprobs(m, prompts[a.prompt_index[r]], toks, temperature=0.7)
        assert (ref - torch.tensor(a.logprobs[r])).abs().max() < 1e-4


def test_release_resume_and_update_weights():
    m, m2 = _tiny("llama", seed=0), _tiny("llama", seed=1)  # untied: tied random models just echo the prompt
    eng = NativeEngine.from_hf(m, dtype=torch.float32, num_kv_tokens=1024)
    prompts = _prompts([6, 11])
    sp = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = eng.generate(prompts, sp).token_ids
    eng.release_memory(offload_weights=True)
    assert eng.kv is None
    with pytest.raises(RuntimeError, match="resume"):
        eng.generate(prompts, sp)
    eng.resume()
    assert eng.generate(prompts, sp).token_ids == before
    eng.update_weights(m2.state_dict().items())
    assert eng.last_update_weights_s > 0
    after = eng.generate(prompts, sp).token_ids
    assert after == [_hf_greedy(m2, p, 8) for p in prompts] and after != before
    with pytest.raises(ValueError, match="unknown parameter"):
        eng.update_weights([("model.layers.0.nope.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="merge"):
        eng.update_weights([("model.layers.0.self_attn.q_proj.lora_A.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        eng.update_weights([("model.norm.weight", torch.zeros(3))])


def test_unsupported_architecture_names_model_type_and_hf_backend():
    from transformers import GPT2Config, GPT2LMHeadModel

    m = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    with pytest.raises(ValueError, match=r"'gpt2'.*rollout.name=hf"):
        NativeEngine.from_hf(m)


def test_make_rollout_dispatches_through_the_registry_only(monkeypatch):
    """A backend is one registered builder: make_rollout calls it by name, and names an unknown one's alternatives."""
    from polyrl.errors import ConfigError
    from polyrl.rollout import make_rollout, rollout_backends
    from polyrl.rollout.config import RolloutConfig

    assert {"hf", "native"} <= set(rollout_backends())
    built = []
    monkeypatch.setitem(ROLLOUT_BACKENDS, "echo", lambda cfg, model, **kw: built.append((cfg.name, model, kw)) or "e")
    cpu = torch.device("cpu")
    assert make_rollout(RolloutConfig(name="echo"), "m", pad_token_id=3, device=cpu, max_model_len=9) == "e"
    assert built == [("echo", "m", {"pad_token_id": 3, "device": cpu, "max_model_len": 9})]
    with pytest.raises(ConfigError, match=r"rollout.name='vllm2'.*\['echo', 'hf', 'native'\]"):
        make_rollout(RolloutConfig(name="vllm2"), "m", pad_token_id=3, device=cpu, max_model_len=9)


def test_bad_requests_fail_with_the_value():
    eng = NativeEngine.from_hf(_tiny(), dtype=torch.float32, num_kv_tokens=256, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len=64"):
        eng.generate(_prompts([60]), SamplingParams(max_new_tokens=8))
    with pytest.raises(ValueError, match="forced_lengths"):
        eng.generate(_prompts([4]), SamplingParams(n=2, forced_lengths=[3]))
    with pytest.raises(ValueError, match="empty"):
        eng.generate([[]], SamplingParams())


def test_rows_kept_at_their_limit_continue_on_their_kv_cache():
    """Partial rollouts: rows cut at 4 new tokens keep their KV blocks (handles); the next call continues them and
    greedy decoding gives the one-call tokens and log-probs. Rows past max_num_seqs, and every row after the cache was
    released, are recomputed from their tokens with the same result; blocks never leak."""
    m = _tiny()
    eng = NativeEngine.from_hf(m, dtype=torch.float32, max_num_seqs=4, max_num_batched_tokens=16, num_kv_tokens=1024)
    prompts = _prompts([3, 21, 1, 9, 40])
    full = eng.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=10))
    for release_between in (False, True):
        a = eng.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=4, keep_unfinished=True))
        assert all(h is not None for h in a.handles) and eng.stats["num_kept"] == 5
        assert not eng.blocks.all_free()  # the kept rows hold their blocks between the calls
        if release_between:
            eng.release_memory()
            eng.resume()
        cont = [p + t for p, t in zip(prompts, a.token_ids)]
        b = eng.generate(cont, SamplingParams(n=1, temperature=0.0, max_new_tokens=6, continuations=a.handles))
        assert eng.stats["num_resumed"] == (0 if release_between else 4)  # max_num_seqs=4: the fifth is recomputed
        assert eng.blocks.all_free()
        for i in range(len(prompts)):
            assert a.token_ids[i] + b.token_ids[i] == full.token_ids[i], i
            got = torch.tensor(a.logprobs[i] + b.logprobs[i])
            assert torch.allclose(got, torch.tensor(full.logprobs[i]), atol=1e-4), i
    # a kept row nobody continues lets its blocks go at the next call
    eng.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=4, keep_unfinished=True))
    eng.generate(prompts[:1], SamplingParams(n=1, temperature=0.0, max_new_tokens=2))
    assert eng.blocks.all_free() and eng.kept == []


def test_a_row_whose_last_token_at_the_limit_is_a_stop_token_is_not_kept():
    m = _tiny()
    eng = NativeEngine.from_hf(m, dtype=torch.float32, max_num_seqs=4, max_num_batched_tokens=16, num_kv_tokens=1024)
    candidates = _prompts([3, 21, 1, 9, 40, 7, 15])
    full = eng.generate(candidates, SamplingParams(n=1, temperature=0.0, max_new_tokens=4))
    i = next(i for i, t in enumerate(full.token_ids) if t[3] not in t[:3])  # its 4th token is new: stop there
    prompts, stop = [candidates[i], candidates[i - 1]], full.token_ids[i][3]
    a = eng.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=4, keep_unfinished=True,
                                             stop_token_ids=(stop,)))
    assert a.finish_reason[0] == "stop" and a.handles[0] is None
    assert len(eng.kept) == sum(h is not None for h in a.handles)
    eng.generate(prompts[:1], SamplingParams(n=1, temperature=0.0, max_new_tokens=1))
    assert eng.blocks.all_free()


def test_rows_resuming_on_a_kept_cache_prefill_in_a_step_of_their_own():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_blocks_per_seq=16, forced_max_new=lambda r: 5)
    kept = Sequence(row=0, prompt_index=0, tokens=list(range(30)), num_prompt=30, max_new=5)
    kept.blocks, kept.num_cached, kept.resumed, kept.slot = bm.allocate(8), 29, True, sched.free_slots.pop()
    sched.running.append(kept)
    sched.waiting.append(Sequence(row=1, prompt_index=1, tokens=list(range(12)), num_prompt=12, max_new=5))
    first = sched.schedule()
    assert first.seqs == [kept] and first.chunks == [(29, 1)] and not kept.resumed  # one query over 30 positions
    second = sched.schedule()
    assert [s.row for s in second.seqs] == [1] and second.chunks == [(0, 12)]  # then the new prompt, as usual


def test_waiting_prompts_join_in_batches_not_one_prefill_step_each():
    """64 one-row prompts, 32 seats, rows ending one by one: prompts join once 4 seats (an eighth) are free, so the
    32 that wait take about 8 prefill steps, not 32; greedy tokens equal those of a call with a seat for every row."""
    m = _tiny()
    prompts = _prompts([6] * 64, seed=3)
    lengths = [4 + (7 * i) % 29 for i in range(64)]
    sp = SamplingParams(n=1, temperature=0.0, max_new_tokens=32, forced_lengths=lengths)
    roomy = NativeEngine.from_hf(m, dtype=torch.float32, max_num_seqs=64, num_kv_tokens=4096)
    want = roomy.generate(prompts, sp).token_ids
    eng = NativeEngine.from_hf(m, dtype=torch.float32, max_num_seqs=32, num_kv_tokens=4096)
    assert eng.generate(prompts, sp).token_ids == want
    prefill_steps = eng.stats["num_steps"] - eng.stats["num_decode_steps"]
    assert prefill_steps <= 1 + 32 // 4 + 2, prefill_steps  # the first 32 in one step (256 tokens), then batches


def test_with_forced_lengths_only_rows_at_their_cap_keep_a_cache():
    """Benchmarks emulate EOS with forced lengths: a row that ends before its cap frees its blocks at once, as a row
    ending at a stop token; a row forced to its cap is kept for the next call."""
    m = _tiny()
    eng = NativeEngine.from_hf(m, dtype=torch.float32, max_num_seqs=4, num_kv_tokens=1024)
    prompts = _prompts([5, 7, 3, 9])
    out = eng.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=6, forced_lengths=[6, 2, 6, 3],
                                               max_new_tokens_per_row=[6, 6, 6, 6], keep_unfinished=True))
    assert [h is not None for h in out.handles] == [True, False, True, False]
    assert len(eng.kept) == 2
    eng.generate(prompts[:1], SamplingParams(n=1, temperature=0.0, max_new_tokens=1))
    assert eng.blocks.all_free()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_admission_keeps_greedy_outputs_under_seat_and_block_pressure(seed):
    """Random prompts, n, seats and cache sizes (some small enough to preempt): greedy tokens equal those of an engine
    with a seat and blocks for every row, and no block leaks."""
    g = torch.Generator().manual_seed(seed)
    m = _tiny()
    num, n = int(torch.randint(6, 14, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
    prompts = _prompts(torch.randint(1, 30, (num,), generator=g).tolist(), seed=seed)
    lengths = torch.randint(1, 20, (num * n,), generator=g).tolist()
    sp = SamplingParams(n=n, temperature=0.0, max_new_tokens=20, forced_lengths=lengths)
    want = NativeEngine.from_hf(m, dtype=torch.float32, max_num_seqs=64, num_kv_tokens=4096).generate(prompts, sp)
    eng = NativeEngine.from_hf(m, dtype=torch.float32, max_num_seqs=int(torch.randint(n, 12, (1,), generator=g)),
                               max_num_batched_tokens=24, num_kv_tokens=int(torch.randint(64, 160, (1,), generator=g)),
                               block_size=4)
    assert eng.generate(prompts, sp).token_ids == want.token_ids
    assert eng.blocks.all_free()


def test_sliced_linear_partials_sum_to_the_gemm_and_the_rule_is_cuda_only():
    """`model.sliced_linear` (a split-K over K slices in one batched call, strided views, no copies): its partials sum
    to x W^T. The rule that routes a down projection to it (`model.sliced_down_parts`) keeps CPU, biased and unmeasured
    shapes on the plain GEMM."""
    from polyrl.rollout.native import model
    from polyrl.rollout.native.model import sliced_linear

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 32, generator=g), torch.randn(10, 32, generator=g)
    parts = sliced_linear(x, w, 4)
    assert parts.shape == (4, 6, 10)
    assert torch.allclose(parts.sum(0), x @ w.t(), atol=1e-5)
    assert torch.allclose(parts[1], x[:, 8:16] @ w[:, 8:16].t(), atol=1e-6)  # slice p holds K columns p*K/P ...
    assert model.sliced_down_parts(torch.nn.Linear(8960, 1536, bias=False), 128) == 1  # CPU: plain
