"""Native engine on Mixture-of-Experts models (CPU, CI): tiny random `qwen3_moe` and `qwen2_moe` against HF.

Tolerances as tests/test_native_rollout_on_cpu.py: fp32 greedy tokens equal HF `generate` exactly, log-probs within
1e-4 of HF's log_softmax on the same tokens; FP8 experts (CPU emulation of the e4m3 numbers) within 0.15 nats.
Routing record (R3): the engine's top-k expert ids equal HF's router top-k on the same prompt + response, -1 on the
last token.
"""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from polyrl.rollout.base import SamplingParams  # noqa: E402
from polyrl.rollout.native import NativeEngine  # noqa: E402
from polyrl.rollout.native.moe import FP8Experts, MoE, grouped_linear, sort_by_expert  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny(kind="qwen3_moe", seed=0, layers=3):
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig

    torch.manual_seed(seed)
    # 2 x moe_intermediate != hidden, so a transposed expert layout could not load silently
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                  num_experts_per_tok=2, max_position_embeddings=512, tie_word_embeddings=False)
    if kind == "qwen3_moe":  # one dense layer among the sparse ones, renormalised top-k
        cfg = Qwen3MoeConfig(head_dim=16, norm_topk_prob=True, mlp_only_layers=[1], **common)
    else:  # a shared expert with its sigmoid gate, raw top-k weights
        cfg = Qwen2MoeConfig(shared_expert_intermediate_size=48, norm_topk_prob=False, **common)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # HF initialises routers near zero: spread them so that routing differs per token
        for name, p in m.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    return m


def _prompts(lengths, seed=1, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _hf_greedy(m, prompt, n):
    from transformers import GenerationConfig

    gc = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        return m.generate(torch.tensor([prompt]), generation_config=gc)[0, len(prompt):].tolist()


def _hf_logprobs(m, prompt, toks):
    with torch.no_grad():
        logits = m(torch.tensor([prompt + toks])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(toks)[:, None]).squeeze(1)


def _hf_routes(m, ids):
    """HF's router top-k ids per MoE layer for one sequence: [len(ids), moe layers, k]."""
    got = []
    hooks = [mod.register_forward_hook(lambda _m, _i, out: got.append(out[2]))
             for name, mod in m.named_modules() if name.endswith("mlp.gate")]
    with torch.no_grad():
        m(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return torch.stack(got, dim=1)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_greedy_and_logprobs_equal_hf_under_chunking_sharing_and_continuous_batching(kind):
    m = _tiny(kind)
    eng = NativeEngine.from_hf(m, dtype=torch.float32, max_num_seqs=3, max_num_batched_tokens=16, num_kv_tokens=1024)
    assert sum(isinstance(layer.mlp, MoE) for layer in eng.model.layers) == (2 if kind == "qwen3_moe" else 3)
    prompts = _prompts([3, 21, 1, 9])
    out = eng.generate(prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=10))
    for i, p in enumerate(prompts):
        ref = _hf_greedy(m, p, 10)
        assert out.token_ids[2 * i] == ref and out.token_ids[2 * i + 1] == ref, i
        diff = (_hf_logprobs(m, p, ref) - torch.tensor(out.logprobs[2 * i])).abs().max().item()
        assert diff < 1e-4, diff
    assert out.routed_experts is None and eng.blocks.all_free()


def test_update_weights_round_trip_under_both_hf_expert_layouts():
    """The trainer's fused 3-D names (`experts.gate_up_proj`) and checkpoints' per-expert names load the same."""
    m, m2 = _tiny("qwen2_moe", seed=0), _tiny("qwen2_moe", seed=1)
    eng = NativeEngine.from_hf(m, dtype=torch.float32, num_kv_tokens=1024)
    prompts = _prompts([6, 11])
    sp = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = eng.generate(prompts, sp).token_ids
    eng.update_weights(m2.state_dict().items())
    after = eng.generate(prompts, sp).token_ids
    assert after == [_hf_greedy(m2, p, 8) for p in prompts] and after != before
    for p in eng.model.parameters():  # as offloading does (`p.data = host`): the loader must follow the parameter
        p.data = p.data.clone()
    eng.update_weights(_per_expert(m.state_dict()).items())
    assert eng.generate(prompts, sp).token_ids == before
    with pytest.raises(ValueError, match="shape"):
        eng.update_weights([("model.layers.0.mlp.experts.down_proj", torch.zeros(8, 24, 64))])


def _per_expert(state: dict) -> dict:
    """HF's fused expert tensors split into the per-expert names of checkpoints (and transformers 4.x)."""
    out = {}
    for name, t in state.items():
        if name.endswith("experts.gate_up_proj"):
            for e, w in enumerate(t):
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = w[: w.shape[0] // 2]
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = w[w.shape[0] // 2 :]
        elif name.endswith("experts.down_proj"):
            for e, w in enumerate(t):
                out[name.replace("down_proj", f"{e}.down_proj.weight")] = w
        else:
            out[name] = t
    return out


def test_a_per_expert_state_dict_builds_the_engine_and_a_missing_expert_is_named():
    from types import SimpleNamespace

    m = _tiny("qwen3_moe", layers=1)
    state = _per_expert(m.state_dict())
    view = SimpleNamespace(config=m.config, model=m.model, parameters=m.parameters, state_dict=lambda: state)
    eng = NativeEngine.from_hf(view, dtype=torch.float32, num_kv_tokens=256)
    p = _prompts([5])
    assert eng.generate(p, SamplingParams(temperature=0.0, max_new_tokens=6)).token_ids[0] == _hf_greedy(m, p[0], 6)
    del state["model.layers.0.mlp.experts.7.down_proj.weight"]
    with pytest.raises(ValueError, match="down_proj"):
        NativeEngine.from_hf(view, dtype=torch.float32, num_kv_tokens=256)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_recorded_routes_equal_hf_router_top_k_on_prompt_and_response(kind):
    m = _tiny(kind)
    # block_size 4: odd prompt lengths fork a partial block (its routes are copied with its K/V); few KV tokens:
    # preemption recomputes rows
    eng = NativeEngine.from_hf(m, dtype=torch.float32, max_num_seqs=4, max_num_batched_tokens=16, num_kv_tokens=56,
                               block_size=4, record_routes=True)
    prompts = _prompts([7, 13, 2])
    out = eng.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=3))
    num_moe = 2 if kind == "qwen3_moe" else 3
    for r, toks in enumerate(out.token_ids):
        ids = prompts[out.prompt_index[r]] + toks
        got = out.routed_experts[r]
        assert got.dtype == torch.int16 and got.shape == (len(ids), num_moe, 2)
        assert (got[-1] == -1).all()
        ref = _hf_routes(m, ids)[:-1]
        # top-2 of 8 as a set: HF and the engine may order a near-tie differently within the k
        assert torch.equal(got[:-1].long().sort(-1).values, ref.sort(-1).values), r
    assert eng.stats["num_preempted"] > 0 and eng.blocks.all_free()


def test_routes_stop_at_a_stop_token_and_survive_release_and_resume():
    m = _tiny("qwen3_moe")
    eng = NativeEngine.from_hf(m, dtype=torch.float32, num_kv_tokens=512, record_routes=True)
    p = _prompts([9])
    ref = _hf_greedy(m, p[0], 10)
    stop = ref[3]
    eng.release_memory()
    eng.resume()
    out = eng.generate(p, SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=(stop,)))
    toks = out.token_ids[0]
    assert toks == ref[: ref.index(stop) + 1] and out.routed_experts[0].shape[0] == 9 + len(toks)
    assert torch.equal(out.routed_experts[0][:-1].long().sort(-1).values,
                       _hf_routes(m, p[0] + toks)[:-1].sort(-1).values)


def test_record_routes_on_a_dense_model_is_refused():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    m = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    with pytest.raises(ValueError, match="record_routes=True needs a Mixture-of-Experts model"):
        NativeEngine.from_hf(m, dtype=torch.float32, num_kv_tokens=64, record_routes=True)


def test_fp8_experts_and_kv_stay_close_to_hf_and_requantise_on_update():
    m, m2 = _tiny("qwen2_moe", seed=0), _tiny("qwen2_moe", seed=1)
    eng = NativeEngine.from_hf(m, dtype=torch.float32, num_kv_tokens=1024, quantization="fp8", kv_cache_dtype="fp8",
                               record_routes=True)
    assert all(isinstance(layer.mlp.experts, FP8Experts) for layer in eng.model.layers)
    prompts = _prompts([5, 12])
    sp = SamplingParams(temperature=0.0, max_new_tokens=8)
    for model in (m, m2):
        if model is m2:
            eng.update_weights(model.state_dict().items())
        out = eng.generate(prompts, sp)
        for i, p in enumerate(prompts):
            diff = (_hf_logprobs(model, p, out.token_ids[i]) - torch.tensor(out.logprobs[i])).abs().max().item()
            assert diff < 0.15, diff


def test_grouped_gemm_and_the_per_expert_loop_agree_with_empty_experts():
    torch.manual_seed(0)
    ids = torch.tensor([[3, 1], [1, 0], [3, 1], [0, 3]])  # experts 2 and 4 get no rows
    order, offs = sort_by_expert(ids, 5)
    assert offs.tolist() == [2, 5, 5, 8, 8]
    assert ids.reshape(-1)[order].tolist() == [0, 0, 1, 1, 1, 3, 3, 3]
    x, w = torch.randn(8, 16), torch.randn(5, 12, 16)
    ref = torch.cat([x[0:2] @ w[0].t(), x[2:5] @ w[1].t(), x[5:8] @ w[3].t()])
    for kind in ("grouped_mm", "loop"):
        assert torch.allclose(grouped_linear(x, w, offs, kind), ref, atol=1e-5), kind


# ---- models the native engine does not run: the hf backend, said in one line -------------------------------------
def _tiny_mixtral(vocab=64, **kw):
    from transformers import AutoModelForCausalLM, MixtralConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(MixtralConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128, **kw)).eval()


def _tiny_sliding_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True,
                                        sliding_window=16, max_window_layers=1)).eval()


def _build(model, capsys, **rollout):
    from polyrl.rollout import make_rollout
    from polyrl.rollout.config import RolloutConfig

    cfg = RolloutConfig(gpu_memory_utilization=0.5, engine_kwargs={"native": {"num_kv_tokens": 256}},
                        **{k: v for k, v in rollout.items() if k != "enable_rollout_routing_replay"})
    if "enable_rollout_routing_replay" in rollout:  # verl's key (the trainer's config defines it)
        cfg.enable_rollout_routing_replay = rollout["enable_rollout_routing_replay"]
    capsys.readouterr()
    eng = make_rollout(cfg, model, pad_token_id=0, device=torch.device("cpu"), max_model_len=64)
    return eng, capsys.readouterr().out


@pytest.mark.parametrize("make, why", [(_tiny_mixtral, "model_type='mixtral'"),
                                       (_tiny_sliding_qwen2, "sliding-window")])
def test_a_model_the_engine_does_not_run_generates_on_hf_with_one_line_saying_why(make, why, capsys):
    from polyrl.rollout.hf import HFRollout

    m = make()
    eng, out = _build(m, capsys)
    assert isinstance(eng, HFRollout)
    lines = [line for line in out.splitlines() if line.startswith("polyrl:")]
    assert len(lines) == 1 and why in lines[0] and "rollout.name=hf" in lines[0], out
    p = _prompts([4], vocab=64)
    gen = eng.generate(p, SamplingParams(temperature=0.0, max_new_tokens=5))
    assert gen.token_ids[0] == _hf_greedy(m, p[0], 5)


@pytest.mark.parametrize("key", [dict(quantization="fp8"), dict(kv_cache_dtype="fp8"),
                                 dict(enable_rollout_routing_replay=True)])
def test_where_hf_cannot_serve_the_config_either_one_sentence_names_the_supported_types(key, capsys):
    from polyrl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model_type='mixtral'.*'qwen3_moe'") as e:
        _build(_tiny_mixtral(), capsys, **key)
    assert str(e.value).count(". ") == 0 and next(iter(key)) in str(e.value)


def test_routing_replay_key_reaches_the_engine_and_is_refused_on_a_dense_model(capsys):
    from polyrl.errors import ConfigError
    from transformers import Qwen3Config, Qwen3ForCausalLM

    eng, _ = _build(_tiny("qwen3_moe", layers=1), capsys, enable_rollout_routing_replay=True)
    assert isinstance(eng, NativeEngine) and eng.routes is not None
    eng, _ = _build(_tiny("qwen3_moe", layers=1), capsys)
    assert eng.routes is None
    dense = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    with pytest.raises(ConfigError, match="enable_rollout_routing_replay=True.*'qwen3'.*set it to False"):
        _build(dense, capsys, enable_rollout_routing_replay=True)


def test_polyrl_train_on_an_unsupported_moe_family_runs_on_hf(tmp_path, capsys):
    """What issue 47 saw as a ValueError traceback, through the real `polyrl train`: exit 0 and the one line."""
    from polyrl.cli import main as cli_main
    from polyrl.data.dataset import write_parquet
    from polyrl.data.synthetic import make_rows
    from polyrl.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    model_dir = tmp_path / "mixtral"
    _tiny_mixtral(len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                  bos_token_id=None).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    write_parquet(make_rows("reverse", 8, seed=1, split="train"), tmp_path / "train.parquet")
    code = cli_main(["train", "algorithm.adv_estimator=grpo", f"data.train_files={tmp_path / 'train.parquet'}",
                     "data.train_batch_size=2", "data.max_prompt_length=32", "data.max_response_length=4",
                     f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                     "actor_rollout_ref.rollout.n=2", "trainer.total_training_steps=1", "trainer.logger=[console]",
                     f"trainer.run_dir={tmp_path / 'run'}", f"trainer.default_local_dir={tmp_path / 'ckpt'}",
                     "trainer.save_freq=-1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert sum("model_type='mixtral'" in line and "rollout.name=hf" in line for line in out.splitlines()) == 1, out


# ---- benchmarks/moe_decode.py's CPU-side pieces ---------------------------------------------------------------------
def _bench():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "moe_decode.py"
    spec = importlib.util.spec_from_file_location("moe_decode", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_moe_decode_benchmark_roofline_arithmetic_and_model_build():
    b = _bench()
    s = b.spec(2, vocab_size=64, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, num_experts=8,
               num_experts_per_tok=2, moe_intermediate_size=8)
    assert s.moe_layers == (0, 1) and b.spec().num_layers == 48 and b.spec(24).num_layers == 24
    assert b.expected_experts_touched(128, 8, 1) == pytest.approx(8)
    assert b.expected_experts_touched(128, 8, 256) == pytest.approx(128, abs=1e-3)
    model, inv_freq = b.build_model(s, "cpu")
    assert inv_freq.shape == (8,) and model.layers[0].mlp.router.weight.std() > 0.5
    all_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith("embed."))
    expert_bytes = 2 * 8 * 3 * 32 * 8 * 4  # 2 layers x 8 experts x (gate, up, down) x 32 x 8 fp32
    one_row = all_bytes - expert_bytes * (1 - 2 / 8)  # one token reaches 2 of 8 experts per layer
    assert b.step_weight_bytes(model, 1) == pytest.approx(one_row)
    assert b.bf16_step_weight_bytes(model, 1) == pytest.approx(one_row / 2)
    # 2 rows, prompt 10, 3 new tokens: 2 decode steps over contexts 11 and 12
    assert b.decode_roofline(2, 10, 3, 100.0, 5, 1000.0) == pytest.approx(4 / ((2 * 100 + 2 * (11 + 12) * 5) / 1000))
    assert b.kv_bytes_per_token(b.spec(), fp8=False) == 96 * 1024


def test_moe_decode_benchmark_expert_fns_agree_on_cpu():
    b = _bench()
    torch.manual_seed(0)
    fns, _ = b.expert_mlp_fns(8, 32, 16, "cpu")
    _, order, offs = b.routed_pairs(6, 8, 2, "cpu")
    x = torch.randn(12, 32)
    ref = fns["grouped_mm"](x, offs)
    assert torch.allclose(fns["loop"](x, offs), ref, atol=1e-5)
    fp8 = fns["scaled_grouped_mm (fp8)"](x, offs)
    assert ((fp8 - ref).norm() / ref.norm()).item() < 0.1  # e4m3 weights and activations: a few percent


def test_experts_narrowed_to_intermediate_shards_sum_to_the_whole():
    """Tensor parallelism shards each expert's intermediate dimension from outside (`narrow_intermediate`): the
    shards' outputs are partial sums of the whole layer's."""
    import copy

    from polyrl.rollout.native.moe import Experts, FP8Experts

    torch.manual_seed(0)
    bf = Experts(8, 32, 24)
    with torch.no_grad():
        bf.gate_up.normal_()
        bf.down.normal_()
    x, ids = torch.randn(5, 32), torch.randint(0, 8, (5, 2))
    w = torch.rand(5, 2)
    for ex in (bf, FP8Experts(bf)):
        whole = ex(x, ids, w)
        parts = []
        for lo, hi in ((0, 8), (8, 24)):
            shard = copy.deepcopy(ex)
            shard.narrow_intermediate(lo, hi)
            assert shard.gate_up.shape == (8, 2 * (hi - lo), 32) and shard.down.shape == (8, 32, hi - lo)
            parts.append(shard(x, ids, w))
        # FP8: each shard quantises its slice of the activation with its own row scales
        tol = 1e-4 if ex is bf else 2e-2
        assert ((parts[0] + parts[1] - whole).abs().max() / whole.abs().max()).item() < tol, type(ex)


@pytest.mark.parametrize("config", ["bf16", "fp8kv_w8"])
def test_moe_decode_benchmark_engine_run_on_a_tiny_spec(config, tmp_path):
    """The GPU script's engine path end to end on CPU (a tiny spec): it builds, generates, and writes its row."""
    from types import SimpleNamespace

    b = _bench()
    s = b.spec(2, vocab_size=64, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, num_experts=8,
               num_experts_per_tok=2, moe_intermediate_size=16)
    rows_out = tmp_path / "rows.jsonl"
    args = SimpleNamespace(layers=None, config=config, rows=4, context=20, new=6, gpu_memory_utilization=0.9,
                           max_num_batched_tokens=64, rows_out=str(rows_out))
    r = b.run_engine(args, 1e11, "cpu", s=s, device="cpu")
    assert r["decode_tokens_per_s"] > 0 and 0 < r["frac_roofline"] and r["prompt"] == 17
    assert "moe_decode.py (engine, decode only)" in rows_out.read_text()


def test_routes_of_rows_continued_on_a_kept_cache_cover_both_calls():
    """Partial rollouts with R3: a row continued on its kept KV cache reports routes for the whole sequence, the
    first call's positions included (they stay in the kept blocks)."""
    m = _tiny("qwen3_moe")
    eng = NativeEngine.from_hf(m, dtype=torch.float32, max_num_seqs=4, max_num_batched_tokens=16, num_kv_tokens=1024,
                               record_routes=True)
    prompts = _prompts([3, 21, 9])
    a = eng.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=4, keep_unfinished=True))
    cont = [p + t for p, t in zip(prompts, a.token_ids)]
    b = eng.generate(cont, SamplingParams(temperature=0.0, max_new_tokens=5, continuations=a.handles))
    assert eng.stats["num_resumed"] == 3
    for i, c in enumerate(cont):
        ids = c + b.token_ids[i]
        got = b.routed_experts[i]
        assert got.shape[0] == len(ids) and (got[-1] == -1).all()
        assert torch.equal(got[:-1].long().sort(-1).values, _hf_routes(m, ids)[:-1].sort(-1).values), i

