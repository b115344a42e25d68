"""Tensor-parallel rollout on CPU (CI): 2 processes over gloo against one process.

Both ranks build the same random tiny model; TP 2 (`shard_model`, tensor_parallel.py) must give TP 1's greedy tokens
exactly, and log-probs within 1e-4 (fp32: only the order of the all-reduce's sum differs). Also: each rank's KV cache
holds only its kv heads, both ranks return the same rows, FP8 KV agrees with TP 1 exactly on tokens, and after
`update_weights` every rank's weights are its slice of the trainer's (FSDP2-sharded) tensors.

MoE (tiny qwen3_moe with a dense layer among the sparse ones, and qwen2_moe with its gated shared expert; 8 experts,
top-2, fp32): the experts are cut along their intermediate dimension; through `ReplicaRollout` (each rank brings
half of the prompts) the group's greedy tokens, log-probs and recorded routes (R3) equal TP 1's, FP8 experts agree
with TP 1 on most tokens, and the weight sync gives every rank its slice of the fused 3-D expert tensors.

One spawn runs every check (starting two interpreters is most of the cost); the tests read its results.
"""

import os
import queue
import tempfile
import time

import pytest
import torch
import torch.multiprocessing as mp

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LP_TOL = 1e-4


def _tiny(kind: str, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512)
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(head_dim=16, tie_word_embeddings=True, **common)).eval()
    return LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **common)).eval()


def _tiny_moe(kind: str, seed=0):
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig

    torch.manual_seed(seed)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                  num_experts_per_tok=2, max_position_embeddings=512, tie_word_embeddings=False)
    if kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(head_dim=16, norm_topk_prob=True, mlp_only_layers=[1], **common)
    else:
        cfg = Qwen2MoeConfig(shared_expert_intermediate_size=48, norm_topk_prob=False, **common)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # HF initialises routers near zero: spread them so that routing differs per token
        for name, p in m.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    return m


MOE_KINDS = ("qwen3_moe", "qwen2_moe")


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 21, 9, 30)]


def _run(engine, sp):
    out = engine.generate(_prompts(), sp)
    return out.token_ids, out.logprobs


def _worker(rank: int, world: int, init_file: str, results):
    import torch.distributed as dist

    from polyrl.rollout.base import SamplingParams
    from polyrl.rollout.native import NativeEngine
    from polyrl.rollout.native.tensor_parallel import ReplicaRollout, TPGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    tp = TPGroup.consecutive(world)
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=8)
    sampled = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=3)
    out = {}
    kw = dict(dtype=torch.float32, max_num_seqs=4, max_num_batched_tokens=32, num_kv_tokens=1024)
    for kind in ("qwen3", "llama"):
        m = _tiny(kind)
        for tag, extra in (("bf", {}), ("fp8kv", {"kv_cache_dtype": "fp8"}), ("fp8w", {"quantization": "fp8"})):
            one = NativeEngine.from_hf(m, **kw, **extra) if rank == 0 else None
            two = NativeEngine.from_hf(m, tp=tp, **kw, **extra)
            out[kind, tag, "kv_heads"] = two.kv.shape[-2]
            out[kind, tag, "greedy"] = (_run(one, greedy) if one else None, _run(two, greedy))
            if tag == "bf":
                out[kind, tag, "sampled"] = (_run(one, sampled) if one else None, _run(two, sampled))
        # weight sync: the trainer's FSDP2 shards -> this rank's TP slices
        out[kind, "sync"] = _weight_sync_check(kind, tp, kw)
        out[kind, "kept"] = _continued_on_kept_caches(m, tp, kw) + (
            (_run(NativeEngine.from_hf(m, **kw), greedy)[0],) if rank == 0 else (None,))
    for kind in MOE_KINDS:
        m = _tiny_moe(kind)
        mine = _prompts()[:2] if rank == 0 else _prompts()[2:]  # each rank brings its own prompts
        for tag, extra in (("bf", {}), ("fp8w", {"quantization": "fp8"})):
            one = NativeEngine.from_hf(m, record_routes=True, **kw, **extra) if rank == 0 else None
            two = ReplicaRollout(NativeEngine.from_hf(m, record_routes=True, tp=tp, **kw, **extra), tp)
            a, b = (one.generate(_prompts(), greedy) if one else None), two.generate(mine, greedy)
            # numpy: torch tensors would cross the queue as shared memory that dies with this process
            mine_rows = (b.prompt_index, b.token_ids, b.logprobs, [r.numpy() for r in b.routed_experts])
            out[kind, tag, "greedy"] = ((a.token_ids, a.logprobs, [r.numpy() for r in a.routed_experts]) if a
                                        else None, mine_rows)
        out[kind, "sync"] = _weight_sync_check(kind, tp, kw)
    results.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def _continued_on_kept_caches(m, tp, kw):
    """Partial rollouts through `ReplicaRollout`: each rank brings its prompts, every row stops after 3 tokens and
    keeps its cache (`Kept` handles), then continues for 5 more on it. Returns this rank's rows (8 greedy tokens each)
    and how many rows the second call continued on a kept cache."""
    from dataclasses import replace

    from polyrl.rollout.base import SamplingParams
    from polyrl.rollout.native import NativeEngine
    from polyrl.rollout.native.tensor_parallel import ReplicaRollout

    two = ReplicaRollout(NativeEngine.from_hf(m, tp=tp, **kw), tp)
    mine = _prompts()[:2] if tp.rank == 0 else _prompts()[2:]
    sp = SamplingParams(n=1, temperature=0.0, max_new_tokens=8)
    first = two.generate(mine, replace(sp, max_new_tokens_per_row=[3] * len(mine), keep_unfinished=True))
    rows = [p + t for p, t in zip(mine, first.token_ids)]
    then = two.generate(rows, replace(sp, max_new_tokens_per_row=[5] * len(rows), keep_unfinished=True,
                                      continuations=first.handles))
    return [a + b for a, b in zip(first.token_ids, then.token_ids)], two.stats["num_resumed"]


def _weight_sync_check(kind, tp, kw):
    """Perturb a copy of the model, FSDP2-shard it over both ranks (the trainer), stream it into the TP engine; each
    rank's engine tensors must equal its slices of the perturbed full weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from polyrl.distributed.weights import full_tensors_by_layer
    from polyrl.rollout.native import NativeEngine
    from polyrl.rollout.native.model import _hf_targets

    build = _tiny_moe if kind in MOE_KINDS else _tiny
    base = build(kind)
    engine = NativeEngine.from_hf(base, tp=tp, **kw)
    trained = build(kind, seed=7)  # "after an update": other weights
    want = {k: v.clone() for k, v in trained.state_dict().items()}
    mesh = init_device_mesh("cpu", (tp.size,))
    for layer in trained.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(trained, mesh=mesh)
    from polyrl.distributed import weights

    plain, fallbacks = weights.full_tensor, []
    weights.full_tensor = lambda t: fallbacks.append(t) or plain(t)  # FSDP2's row shards take the flat gather
    engine.update_weights(full_tensors_by_layer(trained.state_dict().items()))
    weights.full_tensor = plain
    worst = 0.0
    for name, (dst, lo, hi, _) in _hf_targets(engine.model).items():
        if name not in want:  # a tied lm_head; the per-expert names (the fused 3-D tensors are checked)
            continue
        expect = engine.shards.local_tensor(name, want[name])
        worst = max(worst, (dst[lo:hi] - expect).abs().max().item())
    return worst, len(fallbacks)


@pytest.fixture(scope="module")
def tp_results():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_worker, args=(r, 2, os.path.join(d, "init"), q)) for r in range(2)]
        for p in procs:
            p.start()
        got = {}
        deadline = time.time() + 300
        while len(got) < len(procs) and time.time() < deadline:  # a crashed worker fails the tests now, not at 300 s
            try:
                rank, out = q.get(timeout=2)
                got[rank] = out
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
        for p in procs:
            p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs) and len(got) == len(procs), [p.exitcode for p in procs]
    return got


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("tag", ["bf", "fp8kv", "fp8w"])
def test_tp2_greedy_equals_tp1(tp_results, kind, tag):
    """fp8kv: per-(token, kv head) scales are the same on a shard, so only the sum order differs. fp8w: qkv and
    gate_up rows keep their scales, but the row-parallel o and down quantise their inputs per token over the local
    columns and their weight rows over the local slice, so TP 2 is a (slightly) different FP8 model than TP 1."""
    (tok1, lp1), (tok2, lp2) = tp_results[0][kind, tag, "greedy"]
    if tag == "fp8w":  # a random tiny model's near-ties flip under e4m3 noise: compare rows up to their first
        # different token (deterministic on CPU: 40 of 64 tokens agree here)
        same = [next((i for i, (a, b) in enumerate(zip(r1, r2)) if a != b), len(r1)) for r1, r2 in zip(tok1, tok2)]
        assert sum(same) >= 0.5 * sum(map(len, tok1)), same
        lp1 = [r[:k] for r, k in zip(lp1, same)]
        lp2 = [r[:k] for r, k in zip(lp2, same)]
    else:
        assert tok2 == tok1
    gap = max(abs(a - b) for r1, r2 in zip(lp1, lp2) for a, b in zip(r1, r2))
    assert gap < {"bf": LP_TOL, "fp8kv": 1e-3, "fp8w": 3e-2}[tag], gap
    assert tp_results[1][kind, tag, "greedy"][1] == tp_results[0][kind, tag, "greedy"][1]  # the same on both ranks
    assert tp_results[0][kind, tag, "kv_heads"] == tp_results[1][kind, tag, "kv_heads"] == 1  # 2 kv heads / 2 ranks


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_tp2_sampling_is_the_same_on_both_ranks_and_as_tp1(tp_results, kind):
    (tok1, lp1), (tok2, lp2) = tp_results[0][kind, "bf", "sampled"]
    assert tp_results[1][kind, "bf", "sampled"][1][0] == tok2
    assert tok2 == tok1  # same seed, logits equal to ~1e-6: the same draws


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_tp2_rows_continue_on_their_kept_caches(tp_results, kind):
    """`Kept` handles name each rank's own cache of a row: 3 tokens, then 5 continued on the caches, are the 8 greedy
    tokens of one call (TP 1, each prompt's first row), on both ranks, and every row continued on its cache."""
    want = tp_results[0][kind, "kept"][2]
    for rank in (0, 1):
        tokens, resumed, _ = tp_results[rank][kind, "kept"]
        assert resumed == 4  # the group's 4 rows, on every rank's engine
        assert tokens == want[::2][2 * rank:2 * rank + 2]


@pytest.mark.parametrize("kind", MOE_KINDS)
@pytest.mark.parametrize("tag", ["bf", "fp8w"])
def test_moe_tp2_replica_equals_tp1_tokens_logprobs_and_routes(tp_results, kind, tag):
    """The two ranks' rows (rank 0 brought prompts 0-1, rank 1 prompts 2-3) together are TP 1's rows. fp8w: the
    experts' down rows are quantised over their local columns, so (as for dense FP8) compare rows up to their first
    different token."""
    tok1, lp1, routes1 = tp_results[0][kind, tag, "greedy"][0]
    rows = [tp_results[r][kind, tag, "greedy"][1] for r in (0, 1)]
    routes1 = [torch.from_numpy(r) for r in routes1]
    rows = [(*row[:3], [torch.from_numpy(r) for r in row[3]]) for row in rows]
    assert rows[0][0] == [0, 0, 1, 1] and rows[1][0] == [0, 0, 1, 1]  # each rank's own prompt indices, n=2
    tok2 = rows[0][1] + rows[1][1]
    lp2, routes2 = rows[0][2] + rows[1][2], rows[0][3] + rows[1][3]
    if tag == "fp8w":
        same = [next((i for i, (a, b) in enumerate(zip(r1, r2)) if a != b), len(r1)) for r1, r2 in zip(tok1, tok2)]
        assert sum(same) >= 0.5 * sum(map(len, tok1)), same
    else:
        assert tok2 == tok1
        same = [len(r) for r in tok1]
    gap = max(abs(a - b) for r1, r2, k in zip(lp1, lp2, same) for a, b in zip(r1[:k], r2[:k]))
    assert gap < {"bf": LP_TOL, "fp8w": 0.15}[tag], gap
    assert all(r2.shape == r1.shape and r1.shape[1:] == ((2 if kind == "qwen3_moe" else 3), 2)
               for r1, r2 in zip(routes1, routes2))
    if tag == "bf":  # every forwarded position's expert ids equal, the last (sampled) token -1
        assert all(torch.equal(a, b) and (a[-1] == -1).all() and (a[:-1] >= 0).all() for a, b in zip(routes1, routes2))
    else:  # e4m3 noise moves near-tied router scores: most ids agree up to the last agreeing token
        prompt_lens = [len(p) for p in _prompts() for _ in range(2)]
        agree = [(a[: n + k - 1] == b[: n + k - 1]).float().mean().item()
                 for a, b, k, n in zip(routes1, routes2, same, prompt_lens)]
        assert min(agree) >= 0.8, agree


@pytest.mark.parametrize("kind", ["qwen3", "llama", *MOE_KINDS])
def test_update_weights_gives_each_rank_its_slice(tp_results, kind):
    assert tp_results[0][kind, "sync"] == tp_results[1][kind, "sync"] == (0.0, 0)  # exact, and no per-tensor gather


def test_shard_model_refuses_sizes_that_do_not_divide_the_heads():
    from polyrl.errors import ConfigError
    from polyrl.rollout.native.model import CausalLM, ModelSpec
    from polyrl.rollout.native.tensor_parallel import TPGroup, shard_model

    with torch.device("meta"):
        model = CausalLM(ModelSpec.from_hf_config(_tiny("llama").config))
    with pytest.raises(ConfigError, match="num_key_value_heads=2"):
        shard_model(model, TPGroup(rank=0, size=4))
    shards = shard_model(model, TPGroup(rank=1, size=2))  # meta: the shapes alone
    a = model.layers[0].attn
    assert (a.num_heads, a.num_kv_heads, tuple(a.qkv.weight.shape), tuple(a.o.weight.shape)) == (2, 1, (64, 64),
                                                                                               (64, 32))
    assert tuple(model.layers[0].mlp.down.weight.shape) == (64, 64) and shards.full.num_heads == 4


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_moe_shards_load_the_same_from_fused_and_per_expert_names(kind):
    """One process, rank 1 of 2 (shapes and loading only): each expert keeps half of its intermediate columns, the
    shared expert half of its own, the router and the shared gate whole; HF's per-expert names (checkpoints, older
    transformers) slice to the same local weights as the fused 3-D tensors."""
    from polyrl.rollout.native.model import CausalLM, ModelSpec, load_hf_weights
    from polyrl.rollout.native.moe import MoE
    from polyrl.rollout.native.tensor_parallel import TPGroup, shard_model

    hf = _tiny_moe(kind)
    full = hf.state_dict()
    per_expert = {}
    for name, t in full.items():
        if name.endswith("experts.gate_up_proj"):
            I = t.shape[1] // 2
            for e in range(t.shape[0]):
                per_expert[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = t[e, :I]
                per_expert[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = t[e, I:]
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                per_expert[name.replace("down_proj", f"{e}.down_proj.weight")] = t[e]
        else:
            per_expert[name] = t
    got = []
    for named in (full, per_expert):
        with torch.device("meta"):
            model = CausalLM(ModelSpec.from_hf_config(hf.config))
        shards = shard_model(model, TPGroup(rank=1, size=2), log=lambda _: None)
        model.to_empty(device="cpu")
        load_hf_weights(model, shards.local_tensors(named.items()))
        got.append(model)
    a, b = got
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    m = next(layer.mlp for layer in a.layers if isinstance(layer.mlp, MoE))
    gu = full["model.layers.0.mlp.experts.gate_up_proj"]  # [8, 48, 64]: gate rows 0-23, up rows 24-47
    assert torch.equal(m.experts.gate_up.data, torch.cat([gu[:, 12:24], gu[:, 36:48]], dim=1))
    assert torch.equal(m.experts.down.data, full["model.layers.0.mlp.experts.down_proj"][:, :, 12:24])
    assert torch.equal(m.router.weight.data, full["model.layers.0.mlp.gate.weight"])
    if kind == "qwen2_moe":
        sh = full["model.layers.0.mlp.shared_expert.up_proj.weight"]  # [48, 64]
        assert torch.equal(m.shared.gate_up.weight.data[24:], sh[24:])
        assert m.shared.down.weight.shape == (64, 24) and m.shared_gate.weight.shape == (1, 64)


def test_tp_refuses_sizes_that_do_not_divide_the_experts():
    from polyrl.errors import ConfigError
    from polyrl.rollout.native.model import CausalLM, ModelSpec
    from polyrl.rollout.native.tensor_parallel import TPGroup, shard_model

    with torch.device("meta"):
        model = CausalLM(ModelSpec.from_hf_config(_tiny_moe("qwen3_moe").config))
    model.spec.moe_intermediate_size = 20  # 20 / 8 is not whole, the heads would split
    model.spec.num_heads = model.spec.num_kv_heads = 8
    model.spec.intermediate_size = 96
    with pytest.raises(ConfigError, match="moe_intermediate_size=20"):
        shard_model(model, TPGroup(rank=0, size=8))


# ------------------------------------------------------------------------------------------------ the trainer


def _train_argv(model_dir, data_dir, out, tp, steps=2, *extra):
    return ["-m", "polyrl.train", f"data.train_files={data_dir / 'train.parquet'}", "data.train_batch_size=4",
            "data.max_prompt_length=32", "data.max_response_length=6", f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.actor.optim.lr=1e-2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.entropy_coeff=0.01",
            "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.rollout.name=native", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.do_sample=False",  # greedy: the rows cannot depend on which rank drew them
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}", "trainer.device=cpu",
            "trainer.n_gpus_per_node=2", f"trainer.run_dir={out / 'run'}", f"trainer.default_local_dir={out / 'ckpt'}",
            f"trainer.total_training_steps={steps}", "trainer.save_freq=1", "trainer.progress_bar=False",
            "trainer.logger=[file]", *extra]


def _metrics(out):
    import json

    return [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines() if "actor/pg_loss" in x]


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("POLYRL_SLOW_TESTS"), reason="two 2-process runs, ~70 s; POLYRL_SLOW_TESTS=1")
def test_trainer_with_tp2_replicas_matches_data_parallel_rollout(tp_model_dir, synth_data_dir, tmp_path):
    """`polyrl train` on 2 processes, rollout TP 2 (one replica over both ranks, each rank's prompts generated by
    the group) against TP 1 (a replica per rank): the same greedy rollouts, rewards and losses for 2 steps, so the
    weight sync after step 1 gave the TP shards the trainer's weights."""
    one, two = _tp1_and_tp2(tp_model_dir, synth_data_dir, tmp_path)
    assert two[1]["timing_s/update_weights"] > 0


def _tp1_and_tp2(model_dir, data_dir, tmp_path, *extra, code_dir=None, same=()):
    """`polyrl train` with TP 1 and with TP 2, side by side, for 2 steps: both runs' step rows, after checking that
    their rollouts (lengths, scores, the keys `same`) are equal and their losses and gradients agree."""
    import subprocess
    import sys

    path = os.pathsep.join([str(code_dir), os.getcwd()]) if code_dir else os.getcwd()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    runs = {tp: subprocess.Popen([sys.executable, *_train_argv(model_dir, data_dir, tmp_path / str(tp), tp, 2, *extra)],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for tp in (1, 2)}
    for tp, p in runs.items():
        log, _ = p.communicate(timeout=300)
        assert p.returncode == 0, log[-3000:]
    one, two = _metrics(tmp_path / "1"), _metrics(tmp_path / "2")
    assert [r["step"] for r in two] == [1, 2]
    for a, b in zip(one, two):
        for key in ("response_length/mean", "critic/score/mean", *same):
            assert a[key] == b[key], (key, a[key], b[key])
        for key in ("actor/kl_loss", "actor/entropy", "actor/grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 + 1e-4 * abs(a[key]), (key, a[key], b[key])
    return one, two


def test_multi_turn_on_a_tp2_replica_matches_data_parallel_rollout(tp_model_dir, synth_data_dir, tmp_path):
    """Agent loops (a sampled turn, a tool turn, a sampled turn) with rollout TP 2 on 2 processes: the replica's rank
    0 runs the loops of both ranks' prompts and the other rank follows its engine calls (ReplicaRollout.run_led).
    Against TP 1 (a replica per rank), greedy: the same turns, tool calls, rewards and losses for 2 steps."""
    from test_agent_trainer_on_cpu import write_agent_files

    write_agent_files(tmp_path, tmp_path / "code", synth_data_dir, 8)
    agent = [f"data.train_files={tmp_path / 'train.parquet'}", "data.max_response_length=40",
             "actor_rollout_ref.rollout.multi_turn.enable=True",
             f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}",
             f"actor_rollout_ref.rollout.agent.agent_loop_config_path={tmp_path / 'loops.yaml'}"]
    _, two = _tp1_and_tp2(tp_model_dir, synth_data_dir, tmp_path, *agent, code_dir=tmp_path / "code",
                          same=("tool_calls/mean", "reward_extra/tool_reward/mean"))
    assert all(b["num_turns/mean"] == 4 and b["rollout/prefill_tokens_saved"] > 0 for b in two)


def _descendants(pid: int) -> list[int]:
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(d))
            except OSError:
                continue
    return kids + [g for k in kids for g in _descendants(k)]


def _rank_pid(root: int, rank: int) -> int | None:
    for pid in _descendants(root):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"\0RANK={rank}\0".encode() in b"\0" + f.read():
                    return pid
        except OSError:
            continue
    return None


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("POLYRL_SLOW_TESTS"), reason="two 2-process runs, ~70 s; POLYRL_SLOW_TESTS=1")
def test_a_killed_tp_worker_ends_the_run_with_one_sentence_and_resume_works(tp_model_dir, synth_data_dir, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.getcwd()}
    argv = [sys.executable, *_train_argv(tp_model_dir, synth_data_dir, tmp_path, 2, 3, "trainer.resume_mode=auto")]
    job = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    marker = tmp_path / "ckpt" / "latest_checkpointed_iteration.txt"
    deadline = time.time() + 240
    while not marker.exists() and job.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    victim = _rank_pid(job.pid, 1)
    assert victim is not None, "rank 1 not found"
    os.kill(victim, signal.SIGKILL)  # a process this test started (its own job's rank 1)
    _, err = job.communicate(timeout=240)
    assert job.returncode != 0
    last = err.strip().splitlines()[-1]
    assert last.startswith("polyrl: error: the 2-process job stopped") and "resume_mode=auto" in last, last
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [r["step"] for r in _metrics(tmp_path)]
    assert steps[-1] == 3 and steps.count(1) == 1  # resumed after a checkpoint, not from scratch
