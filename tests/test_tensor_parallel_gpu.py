"""Tensor-parallel rollout on 2 GPUs (NCCL, CUDA graphs): TP 2 against TP 1, and weight sync from FSDP2 shards.

Run on a 2-GPU machine (the file is its own torchrun job; pytest starts it):

    PYTHONPATH=. python -m pytest -q tests/test_tensor_parallel_gpu.py -s

Checks, per model (tiny Qwen3 and Llama, fp32 then bf16):
- fp32: TP 2 greedy tokens equal TP 1's and log-probs within 1e-4, with the all-reduces captured in the decode
  graphs (graphs on, the default) and without (enforce_eager);
- bf16: TP 2 greedy tokens equal on both ranks, mean log-prob gap to TP 1 within 1e-2 (the sum order of the
  all-reduce differs);
- FP8 KV and FP8 weights run under TP 2 with graphs and agree between the ranks;
- after `update_weights(full_tensors_by_layer(FSDP2 shards))` each rank's weights equal its slice of the trainer's.
MoE (tiny qwen3_moe and qwen2_moe with its shared expert, 8 experts top-2; experts cut along their intermediate dim,
one all-reduce per MoE block, CUDA graphs on): fp32 TP 2 equals TP 1 on tokens, log-probs and recorded routes; bf16
(`torch._grouped_mm`'s CUTLASS kernel) and FP8 experts agree across ranks and stay close to TP 1; weight sync of the
fused 3-D expert tensors.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                  reason="needs 2 CUDA GPUs")]


def _tiny(kind: str, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    if kind == "qwen3":
        m = Qwen3ForCausalLM(Qwen3Config(head_dim=16, tie_word_embeddings=True, **common))
    else:
        m = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **common))
    return m.to(dtype).eval()


def _tiny_moe(kind: str, dtype):
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig

    torch.manual_seed(0)
    common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                  num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, num_experts=8,
                  num_experts_per_tok=2, max_position_embeddings=1024, tie_word_embeddings=False)
    if kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(head_dim=16, norm_topk_prob=True, mlp_only_layers=[1], **common)
    else:
        cfg = Qwen2MoeConfig(shared_expert_intermediate_size=128, norm_topk_prob=False, **common)
    m = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # HF initialises routers near zero: spread them so that routing differs per token
        for name, p in m.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    return m.to(dtype).eval()


MOE_KINDS = ("qwen3_moe", "qwen2_moe")


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in torch.randint(1, 70, (7,), generator=g)]


def _job(out_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from polyrl.distributed.weights import full_tensors_by_layer
    from polyrl.rollout.base import SamplingParams
    from polyrl.rollout.native import NativeEngine
    from polyrl.rollout.native.model import _hf_targets
    from polyrl.rollout.native.tensor_parallel import TPGroup

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    tp = TPGroup.consecutive(2)
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=40)
    res = {}
    kw = dict(max_num_seqs=6, max_num_batched_tokens=64, num_kv_tokens=4096)
    for kind in ("qwen3", "llama", *MOE_KINDS):
        moe = kind in MOE_KINDS
        build = _tiny_moe if moe else _tiny
        for dtype in (torch.float32, torch.bfloat16):
            m = build(kind, dtype).cuda()
            for tag, extra in (("graphs", {}), ("eager", {"enforce_eager": True}), ("fp8kv", {"kv_cache_dtype": "fp8"}),
                               ("fp8w", {"quantization": "fp8", "fp8_min_elements": 0})):
                if dtype == torch.float32 and tag.startswith("fp8") or moe and tag in ("eager", "fp8kv"):
                    continue
                if moe:
                    extra = {**extra, "record_routes": True}
                one = NativeEngine.from_hf(m, **kw, **extra).generate(_prompts(), greedy)
                two = NativeEngine.from_hf(m, tp=tp, **kw, **extra).generate(_prompts(), greedy)
                res[f"{kind}/{str(dtype)[6:]}/{tag}"] = dict(tok1=one.token_ids, lp1=one.logprobs,
                                                            tok2=two.token_ids, lp2=two.logprobs)
                if moe:
                    res[f"{kind}/{str(dtype)[6:]}/{tag}"].update(routes1=[r.tolist() for r in one.routed_experts],
                                                                 routes2=[r.tolist() for r in two.routed_experts])
        # weight sync from the trainer's FSDP2 shards
        engine = NativeEngine.from_hf(build(kind, torch.bfloat16).cuda(), tp=tp, **kw)
        trained = build(kind, torch.bfloat16)
        with torch.no_grad():
            for p in trained.parameters():
                p.add_(0.01)
        want = {k: v.clone().cuda() for k, v in trained.state_dict().items()}
        trained.cuda()
        mesh = init_device_mesh("cuda", (2,))
        for layer in trained.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(trained, mesh=mesh)
        engine.update_weights(full_tensors_by_layer(trained.state_dict().items()))
        worst = max((dst[lo:hi] - engine.shards.local_tensor(n, want[n])).abs().max().item()
                    for n, (dst, lo, hi, _) in _hf_targets(engine.model).items() if n in want)
        res[f"{kind}/sync"] = worst
    all_res = [None, None]
    dist.all_gather_object(all_res, res)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(all_res, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / "res.json"
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        __file__, str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("tag", ["graphs", "eager"])
def test_fp32_tp2_equals_tp1(results, kind, tag):
    r = results[0][f"{kind}/float32/{tag}"]
    assert r["tok2"] == r["tok1"]
    gap = max(abs(a - b) for x, y in zip(r["lp1"], r["lp2"]) for a, b in zip(x, y))
    assert gap < 1e-4, gap
    assert results[1][f"{kind}/float32/{tag}"]["tok2"] == r["tok2"]


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("tag", ["graphs", "fp8kv", "fp8w"])
def test_bf16_and_fp8_tp2_agree_across_ranks_and_stay_close_to_tp1(results, kind, tag):
    r = results[0][f"{kind}/bfloat16/{tag}"]
    assert results[1][f"{kind}/bfloat16/{tag}"]["tok2"] == r["tok2"]  # one replica, one answer
    same = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(r["tok1"], r["tok2"])]
    gaps = [abs(a - b) for x, y, k in zip(r["lp1"], r["lp2"], same) for a, b in zip(x[:k], y[:k])]
    print(f"{kind} bf16 {tag}: {sum(same)}/{sum(map(len, r['tok1']))} tokens before the first difference, "
          f"mean |logprob gap| {sum(gaps) / max(1, len(gaps)):.2e}")
    assert sum(gaps) / max(1, len(gaps)) < (1e-2 if tag != "fp8w" else 3e-2)
    assert sum(same) >= 0.5 * sum(map(len, r["tok1"]))


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_moe_fp32_tp2_with_graphs_equals_tp1_with_routes(results, kind):
    r = results[0][f"{kind}/float32/graphs"]
    assert r["tok2"] == r["tok1"] and results[1][f"{kind}/float32/graphs"]["tok2"] == r["tok2"]
    gap = max(abs(a - b) for x, y in zip(r["lp1"], r["lp2"]) for a, b in zip(x, y))
    assert gap < 1e-4, gap
    assert r["routes2"] == r["routes1"] and results[1][f"{kind}/float32/graphs"]["routes2"] == r["routes2"]


@pytest.mark.parametrize("kind", MOE_KINDS)
@pytest.mark.parametrize("tag", ["graphs", "fp8w"])
def test_moe_bf16_and_fp8_tp2_agree_across_ranks_and_stay_close_to_tp1(results, kind, tag):
    r = results[0][f"{kind}/bfloat16/{tag}"]
    other = results[1][f"{kind}/bfloat16/{tag}"]
    assert other["tok2"] == r["tok2"] and other["routes2"] == r["routes2"]  # one replica, one answer, one routing
    same = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(r["tok1"], r["tok2"])]
    gaps = [abs(a - b) for x, y, k in zip(r["lp1"], r["lp2"], same) for a, b in zip(x[:k], y[:k])]
    n = [len(p) for p in _prompts() for _ in range(2)]
    agree = [sum(a == b for a, b in zip(x[: m + k - 1], y[: m + k - 1])) / max(1, m + k - 1)
             for x, y, k, m in zip(r["routes1"], r["routes2"], same, n)]
    print(f"{kind} bf16 {tag}: {sum(same)}/{sum(map(len, r['tok1']))} tokens before the first difference, "
          f"mean |logprob gap| {sum(gaps) / max(1, len(gaps)):.2e}, routes equal at {min(agree):.0%}+ of positions")
    assert sum(gaps) / max(1, len(gaps)) < (1e-2 if tag != "fp8w" else 5e-2)
    if tag != "fp8w":
        assert sum(same) >= 0.5 * sum(map(len, r["tok1"])) and min(agree) >= 0.8
    # FP8 experts: each rank's down-projection scales come from its slice of the intermediate dim, so TP 2 is a
    # slightly different FP8 model than TP 1; on these random tiny routers that flips a route early (H200, 2026-11-27:
    # 208 / 238 of 560 tokens before the first difference, routes 84% / 54% equal, log-prob gaps 6e-3 as dense FP8's)


@pytest.mark.parametrize("kind", ["qwen3", "llama", *MOE_KINDS])
def test_each_rank_holds_its_slice_of_the_trainers_weights(results, kind):
    assert results[0][f"{kind}/sync"] == 0.0 and results[1][f"{kind}/sync"] == 0.0


def test_multi_turn_agent_loops_train_on_a_tp2_replica_with_graphs(tp_model_dir, synth_data_dir, tmp_path):
    """`polyrl train` on 2 GPUs, rollout TP 2 (NCCL, CUDA graphs), multi-turn: rank 0 of the replica runs both ranks'
    agent loops and rank 1 follows its engine calls (ReplicaRollout.run_led); 2 steps with a tool turn in every
    trajectory, kept caches between turns, and a weight sync between the steps."""
    from test_agent_trainer_on_cpu import write_agent_files
    from test_tensor_parallel_on_cpu import _metrics, _train_argv

    write_agent_files(tmp_path, tmp_path / "code", synth_data_dir, 8)
    argv = _train_argv(tp_model_dir, synth_data_dir, tmp_path, 2, 2, "trainer.device=cuda",
                       f"data.train_files={tmp_path / 'train.parquet'}", "data.max_response_length=40",
                       "actor_rollout_ref.rollout.multi_turn.enable=True",
                       f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}",
                       f"actor_rollout_ref.rollout.agent.agent_loop_config_path={tmp_path / 'loops.yaml'}")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(tmp_path / "code"), os.getcwd()])}
    p = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["num_turns/mean"] == 4 and r["tool_calls/mean"] == 1 and r["rollout/prefill_tokens_saved"] > 0
    assert rows[1]["timing_s/update_weights"] > 0


if __name__ == "__main__":
    _job(sys.argv[1])
