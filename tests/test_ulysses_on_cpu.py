"""Ulysses sequence parallelism on CPU (gloo): 2 processes with sp=2 give the 1-process packed results.

The 2-process job is this file under torchrun (`__main__` at the bottom), started once for the module: each rank
computes log-probs/entropy, their parameter gradients, and an `Actor.update` under FSDP2 for two tiny models, a
Llama with 4 query / 2 KV heads (heads split evenly) and a Qwen2 with 4 / 1 (the KV head is repeated for 2 ranks),
and saves them; the tests compare with the same computations in this process without SP. fp32 throughout, so the
only differences are summation order (tolerances below).
"""

import copy
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polyrl.algorithms.losses import LossKnobs
from polyrl.distributed.ulysses import check_heads, owned_predictions, pad_packed
from polyrl.errors import ConfigError
from polyrl.learner.actor import Actor, ForwardSettings, UpdateSettings, compute_logprobs, logprobs_and_entropy
from polyrl.learner.batch import build_batch
from polyrl.learner.packing import pack

VALUES = dict(rtol=0, atol=1e-5)  # log-probs / entropy: fp32, packed vs SP-packed differ in summation order only
GRADS = dict(rtol=1e-4, atol=1e-6)
# heads split evenly / one KV head repeated for 2 ranks; the LM head through autograd (a rank without predictions
# needs the empty-anchor path then) / through the fused hand-written backward
ARCHS = {"llama": dict(arch="llama", heads=4, kv_heads=2), "qwen2_kv1": dict(arch="qwen2", heads=4, kv_heads=1)}
FUSED_HEAD = {"llama": False, "qwen2_kv1": True}


def _model(name: str):
    from transformers import AutoModelForCausalLM

    from polyrl.models.tiny import tiny_config

    torch.manual_seed(0)
    cfg = tiny_config(100, hidden_size=64, layers=2, intermediate=64, tie=False, **ARCHS[name])  # head_dim 16
    return AutoModelForCausalLM.from_config(cfg)


def _batch(num_rows=8, seed=11):
    g = torch.Generator().manual_seed(seed)
    rand_len = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))  # noqa: E731
    prompts = [torch.randint(4, 90, (rand_len(2, 12),), generator=g).tolist() for _ in range(num_rows)]
    responses = [torch.randint(4, 90, (rand_len(1, 9),), generator=g).tolist() for _ in range(num_rows)]
    b = build_batch(prompts, responses, pad_token_id=0, device=torch.device("cpu"))
    b["advantages"] = torch.randn(b["responses"].shape, generator=g) * b["response_mask"]
    b["old_log_probs"] = (-2.0 + 0.3 * torch.randn(b["responses"].shape, generator=g)) * b["response_mask"]
    b["ref_log_probs"] = b["old_log_probs"] - 0.1
    return b


def _settings():
    return UpdateSettings(mini_batch_size=4, micro_batch_size=2, ppo_epochs=1, temperature=0.7, loss_mode="vanilla",
                          loss_agg_mode="token-mean", knobs=LossKnobs(), grad_clip=1e9, entropy_coeff=0.01,
                          use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl")


def _grads(model, fwd, batch):
    """Parameter gradients of a loss over log-probs and entropy (plain module: no FSDP averaging involved)."""
    logp, ent = logprobs_and_entropy(model, batch, 0.7, True, fwd)
    ((logp * batch["advantages"]).sum() + 0.1 * ent.sum()).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def compute_all(env=None, device: str = "cpu") -> dict:
    """Everything the tests compare: with `env` (a torchrun job) under sp=2, else in one process, packed.

    With dp=2 (4 processes) each SP group trains its data shard: its half of every mini-batch, as the trainer's
    `shard_prompts` deals them. On CUDA (tests/test_ulysses_gpu.py) matmuls stay fp32 and attention runs in the
    bf16 varlen kernel, in both the reference and the SP run."""
    from polyrl.learner import packing
    from polyrl.distributed.data import shard_prompts
    from polyrl.distributed.parallelize import parallelize, param_groups
    from polyrl.distributed.weights import full_state_dict
    from polyrl.learner.actor import make_scheduler
    from polyrl.learner.batch import select
    from polyrl.learner.config import FSDPConfig

    dp_rank, dp_size = (env.dp_rank, env.dp_size) if env else (0, 1)
    rows = shard_prompts(8, _settings().mini_batch_size, dp_rank, dp_size)
    batch = {k: v.to(device) for k, v in select(_batch(), torch.tensor(rows)).items()}
    settings = dataclasses.replace(_settings(), mini_batch_size=_settings().mini_batch_size // dp_size)
    out = {"rows": rows}
    if env is not None:  # the trainer-facing pieces of DistEnv: the data-parallel view, sharing within an SP group
        out["data_view"] = (env.data.rank, env.data.world_size, env.data.all_gather_object(env.rank))
        out["shared"] = env.share_with_sp_group({"rank": torch.tensor([env.rank], device=device), "t": ("x", env.rank)})
    for name in ARCHS:
        fwd = ForwardSettings(pack_on_cpu=True, logprob_chunk_size=7, fused_head=FUSED_HEAD[name],
                              compute_dtype="float32", sp=env.sp if env else None)
        model = _model(name).to(device)
        with torch.no_grad():
            logp, ent = logprobs_and_entropy(model, batch, 0.7, True, fwd)
        out[name] = dict(logp=logp, ent=ent,
                         ref=compute_logprobs(model, batch, temperature=0.7, micro_batch_size=3, fwd=fwd),
                         grads=_grads(copy.deepcopy(model), fwd, batch))
        if env is not None:  # each rank holds its partial gradient (its rows, tokens, heads): the sum is the gradient
            for g in out[name]["grads"].values():
                torch.distributed.all_reduce(g)
            parallelize(model, env.mesh, FSDPConfig(dtype="float32"), env.device)
        opt = torch.optim.SGD(param_groups(model), lr=1.0)
        sched = make_scheduler(opt, total_steps=1, warmup_steps=0, kind="constant", min_lr_ratio=0.0, num_cycles=0.5)
        actor = Actor(model, opt, sched, dp=env, fwd=dataclasses.replace(fwd, sp=None))  # Actor sets sp from env
        out[name]["metrics"] = actor.update(batch, settings)
        out[name]["weights"] = full_state_dict(model)
    out["cuda_varlen_kernel"] = device == "cuda" and packing._VARLEN is not None and not packing._VARLEN_BROKEN
    return {k: _to_cpu(v) for k, v in out.items()}


def _to_cpu(x):
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    return x.cpu() if isinstance(x, torch.Tensor) else x


# ------------------------------------------------------------------------------------------------ pure pieces


def test_padding_is_its_own_segment_and_ranks_own_their_predictions():
    packed = pack(_batch(5, seed=1))
    N = packed.num_tokens
    ids, pos, cu, max_len = pad_packed(packed.input_ids, packed.position_ids, packed.cu_seqlens, packed.max_seqlen, 4)
    pad = ids.shape[1] - N
    assert ids.shape[1] % 4 == 0 and pad == -N % 4
    if pad:  # the pad tokens form one extra segment after every real one: no real token attends to them
        assert cu.tolist() == packed.cu_seqlens.tolist() + [N + pad] and pos[0, N:].tolist() == list(range(pad))
    bounds = owned_predictions(packed.pred_index, ids.shape[1], 4)
    n = ids.shape[1] // 4
    assert bounds[0] == 0 and bounds[-1] == len(packed.pred_index)
    for r in range(4):
        mine = packed.pred_index[bounds[r]:bounds[r + 1]]
        assert ((mine >= r * n) & (mine < (r + 1) * n)).all()


def test_head_layouts_that_do_not_split_are_refused():
    check_heads(12, 2, 2)
    check_heads(12, 2, 4)  # 2 KV heads repeated for 4 ranks
    for heads, kv, sp in ((12, 2, 8), (12, 4, 3), (12, 3, 2)):
        with pytest.raises(ConfigError, match="ulysses_sequence_parallel_size"):
            check_heads(heads, kv, sp)


def test_checks_refuse_what_sp_does_not_support(monkeypatch):
    from polyrl.trainer.checks import check_sequence_parallel
    from polyrl.trainer.config import PPOConfig

    monkeypatch.setenv("WORLD_SIZE", "4")

    def refused(**keys):
        cfg = PPOConfig()
        cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size = keys.pop("sp", 2)
        cfg.actor_rollout_ref.ref.ulysses_sequence_parallel_size = keys.pop("ref_sp", 1)
        cfg.critic.ulysses_sequence_parallel_size = keys.pop("critic_sp", 1)
        cfg.actor_rollout_ref.model.use_remove_padding = keys.pop("use_remove_padding", True)
        try:
            check_sequence_parallel(cfg)
        except ConfigError as e:
            return str(e)
        return None

    assert refused() is None and refused(ref_sp=2) is None and refused(sp=4, ref_sp=4) is None
    assert "use_remove_padding=True" in refused(use_remove_padding=False)
    assert "does not divide the 4 processes" in refused(sp=3)
    assert "critic" in refused(critic_sp=2)
    assert "ref.ulysses_sequence_parallel_size=4" in refused(ref_sp=4)


# ------------------------------------------------------------------------------------------------ 2 processes


def _micro_batches_with_an_idle_rank(batch) -> int:
    """How many of the update's micro-batches leave one of 2 SP ranks without a prediction (only prompt tokens)."""
    from polyrl.learner.batch import select, trim_columns

    idle = 0
    for start in range(0, batch["responses"].shape[0], _settings().micro_batch_size):
        packed = pack(trim_columns(select(batch, slice(start, start + _settings().micro_batch_size))))
        b = owned_predictions(packed.pred_index, packed.num_tokens + packed.num_tokens % 2, 2)
        idle += min(b[1] - b[0], b[2] - b[1]) == 0
    return idle


WORLDS = (2, 4)  # sp=2 alone (dp=1), and dp=2 x sp=2


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """(1-process results, {world size: every rank's results}) for sp=2 jobs of 2 and 4 processes, run together."""
    from polyrl.distributed.launch import torchrun_command

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path.cwd())}
    outs = {w: tmp_path_factory.mktemp(f"ulysses{w}") for w in WORLDS}
    procs = {w: subprocess.Popen(torchrun_command(w, [__file__, str(outs[w])]), env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for w in WORLDS}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 6 ranks run beside this process (conftest.one_thread)
    one = compute_all()
    torch.set_num_threads(threads)
    for w, job in procs.items():
        log, _ = job.communicate(timeout=300)
        assert job.returncode == 0, log[-3000:]
    return one, {w: [torch.load(outs[w] / f"rank{r}.pt") for r in range(w)] for w in WORLDS}


@pytest.mark.parametrize("world", WORLDS)
def test_data_view_and_sharing_within_the_sp_group(jobs, world):
    _, runs = jobs
    for rank, got in enumerate(runs[world]):
        leader = rank - rank % 2  # SP groups are consecutive ranks
        assert got["data_view"] == (rank // 2, world // 2, list(range(rank % 2, world, 2)))
        assert got["shared"]["rank"].tolist() == [leader] and got["shared"]["t"] == ("x", leader)
        assert got["rows"] == runs[world][leader]["rows"]  # an SP group trains one data shard


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", list(ARCHS))
def test_sp2_logprobs_entropy_and_gradients_equal_one_process(jobs, name, world):
    one, runs = jobs
    batch = _batch()
    assert batch["attention_mask"].sum() % 2 == 1  # the whole packed row needs padding: that path is exercised
    assert _micro_batches_with_an_idle_rank(batch) > 0  # and the update has a rank with no prediction to backprop
    ref = one[name]
    assert ref["grads"]["model.layers.0.self_attn.k_proj.weight"].abs().max() > 1e-3
    for rank in runs[world]:  # both ranks of an SP group see their data shard's whole micro-batch
        rows = rank["rows"]
        assert len(rows) == 8 * 2 // world
        for key in ("logp", "ent", "ref"):
            torch.testing.assert_close(rank[name][key], ref[key][rows], **VALUES)
        for n, g in ref["grads"].items():  # summed over all ranks: neither lost nor counted twice
            torch.testing.assert_close(rank[name]["grads"][n], g, **GRADS, msg=n)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", list(ARCHS))
def test_sp2_actor_update_equals_one_process(jobs, name, world):
    one, runs = jobs
    ref, got = one[name], runs[world][0][name]
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "actor/pg_clipfrac"):
        assert got["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-4, abs=1e-6), key
    for rank in runs[world][1:]:  # metrics are global sums over the data shards, the same on every rank
        assert rank[name]["metrics"]["actor/pg_loss"] == pytest.approx(got["metrics"]["actor/pg_loss"], rel=1e-6)
    before = {n: p.detach() for n, p in _model(name).state_dict().items()}
    assert max((ref["weights"][n] - before[n]).abs().max() for n in before) > 1e-2  # the update moved weights
    for n, w in ref["weights"].items():
        torch.testing.assert_close(got["weights"][n], w, rtol=0, atol=1e-5, msg=n)


# ------------------------------------------------------------------------------------------------ the trainer


def test_trainer_with_sp2_matches_one_process(tiny_model_dir, synth_data_dir, tmp_path, one_thread):
    """2 GRPO steps of PPOTrainer with sp=2 on 2 processes (one data shard) == 1 process (the tiny Llama has 2 query
    heads and 1 KV head, repeated)."""
    import inspect

    from polyrl.distributed.launch import torchrun_command
    from polyrl.trainer import ppo
    from test_distributed_on_cpu import _args, _steps, _train

    if "sp_size=" not in inspect.getsource(ppo.PPOTrainer.__init__):
        pytest.skip("trainer/ppo.py does not build its DistEnv with sp_size yet (docs/multi_gpu.md, Ulysses)")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path.cwd())}
    sp = "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"
    job = subprocess.Popen(torchrun_command(2, [__file__, "train", *_args(tiny_model_dir, synth_data_dir,
                                                                          tmp_path / "sp2", 2, sp)]),
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _train(_args(tiny_model_dir, synth_data_dir, tmp_path / "one", 2))
    log, _ = job.communicate(timeout=300)
    assert job.returncode == 0, log[-3000:]
    ref, got = _steps(tmp_path / "one"), _steps(tmp_path / "sp2")
    assert [r["step"] for r in got] == [1, 2]
    for a, b in zip(ref, got):
        for key in ("critic/score/mean", "response_length/mean"):  # the same rollouts
            assert a[key] == b[key], key
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 + 1e-4 * abs(a[key]), (key, a[key], b[key])


if __name__ == "__main__":  # one rank of an sp=2 job: OUT_DIR [cpu|cuda], or `train KEY=VALUE...` (the trainer)
    from polyrl.distributed import DistEnv

    torch.set_num_threads(1)
    if sys.argv[1] == "train":
        sys.path.insert(0, str(Path(__file__).parent))
        from test_distributed_on_cpu import _train

        _train(sys.argv[2:])
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        sys.exit(0)
    device = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    dist_env = DistEnv.setup(device, sp_size=2)
    result = compute_all(dist_env, device)
    torch.save(result, Path(sys.argv[1]) / f"rank{dist_env.rank}.pt")
    dist_env.close()
