"""MoE routing replay (R3) through the one-step off-policy pipeline (async_ppo.py, issue 47): the rollout process's
native engine records each token's experts, the batch carries them to the trainer process, whose update replays
them; with partial rollouts a row continued across generation calls keeps the routes of its whole sequence."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from polyrl.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("moe") / "model", arch="qwen3_moe", hidden_size=32, layers=2,
                            heads=2, kv_heads=1, intermediate=64, max_position_embeddings=128)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(argv: list[str]) -> list[subprocess.Popen]:
    """`polyrl train argv` as the 2 processes of one gloo job (as tests/test_async_ppo_on_cpu.py starts them)."""
    port = str(_free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path.cwd()),
           "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    return [subprocess.Popen([sys.executable, "-m", "polyrl.train", *argv], text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
            for r in (1, 0)]


def test_off_policy_r3_carries_the_rollouts_routes_to_the_trainer(moe_dir, synth_data_dir, tmp_path):
    """2 steps one step off-policy: batch 0 fresh, batch 1 generated with weights one step older than the trained
    ones. Every step's update compares the routes it received with its own router's choice
    (`actor/router_agreement`, logged only when the batch holds `routed_experts`), then replays them."""
    argv = [f"data.train_files={synth_data_dir / 'train.parquet'}", "data.train_batch_size=4",
            "data.max_prompt_length=32", "data.max_response_length=6", f"actor_rollout_ref.model.path={moe_dir}",
            "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.rollout.name=native", "actor_rollout_ref.hybrid_engine=False",
            "actor_rollout_ref.actor.router_replay.mode=R3",
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=True", "trainer.device=cpu",
            f"trainer.run_dir={tmp_path / 'run'}", f"trainer.default_local_dir={tmp_path / 'ckpt'}",
            "trainer.total_training_steps=2", "trainer.progress_bar=False", "trainer.logger=[file]"]
    procs = _job(argv)
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert [r["async/staleness/max"] for r in steps] == [0.0, 1.0]  # the second batch is off-policy
    for r in steps:
        # the engine's routes reached the update; on CPU the fp32 engine routes as the trainer's forward does, and a
        # one-step-old router (lr 1e-3) still mostly agrees
        assert r["actor/router_agreement"] > 0.9, (r["step"], r["actor/router_agreement"])
    assert steps[0]["actor/router_agreement"] > 0.99  # fresh batch: the very weights that generated it
    assert "rollout_corr/kl" in steps[0]  # fresh batch: the mismatch KL of the replayed forward


def test_partial_rollouts_keep_each_rows_routes_across_calls(moe_dir, one_thread):
    """A row decoded in two capped calls (its KV cache kept between them) ends with routes for its whole sequence,
    equal to the trainer's forward's own routes over prompt + response; `as_part` hands them to the batch."""
    from types import SimpleNamespace

    from polyrl.learner.actor import ForwardSettings, compute_logprobs
    from polyrl.learner.batch import build_batch
    from polyrl.models.loader import load_causal_lm
    from polyrl.models.moe import MoERouting
    from polyrl.rollout import SamplingParams
    from polyrl.rollout.native import NativeEngine
    from polyrl.trainer.partial_rollout import PartialRollouts, as_part, continuation_sampling
    from polyrl.trainer.rollout_batch import routes_batch

    model = load_causal_lm(str(moe_dir)).eval()
    engine = NativeEngine.from_hf(model, device="cpu", max_num_seqs=8, max_model_len=64, num_kv_tokens=512,
                                  record_routes=True, seed=3)
    pool = PartialRollouts(n=2, max_response_length=6, max_new_tokens=2)
    pool.add([SimpleNamespace(prompt_ids=[5, 17, 30, 41]), SimpleNamespace(prompt_ids=[9, 22, 60])], {"draw": 0})
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, ignore_eos=True, record_routes=True)
    num_calls = 0
    while pool.num_done() < 2:
        prompts, rows, caps = pool.requests()
        pool.absorb(engine.generate(prompts, continuation_sampling(sampling, rows, caps)), rows, caps, version=0)
        num_calls += 1
    assert num_calls == 3 and engine.stats["num_resumed"] > 0  # continued on the kept cache
    samples, out = as_part(pool.take(2))
    assert out.routed_experts is not None and all(len(t) == 6 for t in out.token_ids)
    prompts = [samples[i].prompt_ids for i in out.prompt_index]
    for p, t, r in zip(prompts, out.token_ids, out.routed_experts):
        assert r.shape == (len(p) + len(t), 2, 2) and (r[:-1] >= 0).all() and (r[-1] == -1).all()
    batch = build_batch(prompts, out.token_ids, pad_token_id=0, device=torch.device("cpu"))
    batch["routed_experts"] = routes_batch(out.routed_experts, [len(p) for p in prompts], batch, torch.device("cpu"))
    fwd = ForwardSettings(routing=MoERouting(model))
    _, own = compute_logprobs(model, batch, temperature=1.0, micro_batch_size=8, fwd=fwd, record_routes=True)
    have = batch["routed_experts"][..., 0] >= 0
    same = (batch["routed_experts"].sort(-1).values == own.sort(-1).values).all(-1)
    assert int(have.sum()) == sum(len(p) + len(t) - 1 for p, t in zip(prompts, out.token_ids)) * 2
    assert same[have].float().mean() > 0.99


def test_r2_is_refused_where_the_pipeline_skips_the_old_log_prob_pass():
    """R2 replays the trainer's old-log-prob pass, which stale batches skip unless decoupled correction recomputes
    it: refused there with one sentence, accepted where the pass runs."""
    from polyrl.config import build_config
    from polyrl.errors import ConfigError
    from polyrl.trainer.async_config import check_async
    from polyrl.trainer.config import PPOConfig

    r2 = ["actor_rollout_ref.hybrid_engine=False", "actor_rollout_ref.actor.router_replay.mode=R2"]
    with pytest.raises(ConfigError, match="use R3"):
        check_async(build_config(PPOConfig(), r2))
    with pytest.raises(ConfigError, match="use R3"):
        check_async(build_config(PPOConfig(), [*r2, "algorithm.rollout_correction.rollout_is=token",
                                               "algorithm.rollout_correction.bypass_mode=True"]))
    check_async(build_config(PPOConfig(), [*r2, "algorithm.rollout_correction.rollout_is=token"]))
    check_async(build_config(PPOConfig(), [*r2, "async_training.max_trajectory_age_steps=0"]))
