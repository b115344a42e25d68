"""The off-policy pipeline with pools of processes on CPU (gloo): several trainer ranks (FSDP2) and several rollout
processes, as data-parallel replicas and as one tensor-parallel replica (polyrl/trainer/rollout_pool.py,
polyrl/trainer/async_ppo.py). The 1 + 1 pipeline's own tests are tests/test_async_ppo_on_cpu.py.

The model is a tiny Llama with 2 kv heads (so TP 2 splits it); a saved tiny Qwen config would reload with a BPE
tokenizer instead of the char one (polyrl/models/tiny.py). The native engine runs both on CPU.
"""

import json
import os
import re
import socket

import pytest
import torch
import torch.multiprocessing as mp

from polyrl.rollout.base import Generation
from polyrl.trainer.rollout_pool import Placement, deal_prompts, select_prompts
from test_async_ppo_on_cpu import KILLING_REWARD, _args, _process, _steps, _wait


# ------------------------------------------------------------------------------------------------ pure functions
def test_placement_numbers_trainers_first_then_replicas_of_consecutive_ranks():
    p = Placement(num_trainers=2, num_rollout=4, tp=2)
    assert (p.world_size, p.num_replicas) == (6, 2)
    assert [p.replica_of(r) for r in range(2, 6)] == [0, 0, 1, 1] and [p.leader(j) for j in (0, 1)] == [2, 4]
    assert p.served_by(0) == [2, 3] and p.served_by(1) == [4, 5]  # replica j's weights come from trainer j % T
    assert Placement(1, 3).served_by(0) == [1, 2, 3]
    assert Placement(3, 1).served_by(1) == [] and Placement(3, 1).served_by(0) == [3]


def test_replicas_deal_each_trainer_ranks_shard_in_order():
    """8 prompts, mini-batches of 4, 2 trainer ranks: rank 0 trains [0, 1, 4, 5] and rank 1 [2, 3, 6, 7] (the
    on-policy shards); 2 replicas each generate a contiguous half of every shard, so pieces in replica order are the
    shard in order."""
    deal = deal_prompts(8, 4, num_trainers=2, num_replicas=2)
    assert deal == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    for t in range(2):
        assert deal[0][t] + deal[1][t] == [[0, 1, 4, 5], [2, 3, 6, 7]][t]
    assert deal_prompts(4, 4, 1, 1) == [[[0, 1, 2, 3]]]
    assert deal_prompts(6, 6, 1, 4) == [[[0, 1]], [[2, 3]], [[4]], [[5]]]


def test_select_prompts_keeps_each_prompts_rows_and_renumbers():
    out = Generation(prompt_index=[0, 0, 1, 1, 2, 2], token_ids=[[i] for i in range(6)],
                     logprobs=[[-float(i)] for i in range(6)], finish_reason=["stop"] * 6)
    part = {"prompts": ["a", "b", "c"], "out": out, "scores": [0, 1, 2, 3, 4, 5], "extras": {"acc": list("uvwxyz")},
            "baselines": None, "versions": [7] * 6}
    piece = select_prompts(part, [2, 0])
    assert piece["prompts"] == ["c", "a"] and piece["out"].prompt_index == [0, 0, 1, 1]
    assert piece["out"].token_ids == [[4], [5], [0], [1]] and piece["scores"] == [4, 5, 0, 1]
    assert piece["extras"] == {"acc": ["y", "z", "u", "v"]} and piece["baselines"] is None
    assert piece["versions"] == [7] * 4 and out.prompt_index == [0, 0, 1, 1, 2, 2]  # the source is untouched


def test_pool_keys_are_checked_and_launched():
    from polyrl.config import build_config
    from polyrl.errors import ConfigError
    from polyrl.trainer.async_config import check_async
    from polyrl.trainer.checks import check_tensor_parallel
    from polyrl.trainer.config import PPOConfig
    from polyrl.trainer.job import launch_job

    off = ["actor_rollout_ref.hybrid_engine=False", "trainer.device=cpu"]
    pool = off + ["trainer.n_gpus_per_node=2", "rollout.n_gpus_per_node=2", "data.train_batch_size=4",
                  "actor_rollout_ref.actor.ppo_mini_batch_size=4"]
    check_async(build_config(PPOConfig(), pool))
    check_async(build_config(PPOConfig(), pool + ["data.val_files=x.parquet"]))  # the trainer ranks validate in step
    job = launch_job(build_config(PPOConfig(), pool))
    assert (job.nnodes, job.num_processes) == (1, 4)
    for extra, words in [(["algorithm.filter_groups.enable=True"], "filter_groups"),
                         (["data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                           "rollout.n_gpus_per_node=4"], "fewer than the 4 rollout replicas"),
                         (["data.val_files=x.parquet", "actor_rollout_ref.rollout.multi_turn.enable=True"],
                          "multi-turn rollouts"),
                         (["actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                           "algorithm.rollout_correction.rollout_is=token"], "bypass_mode=True"),
                         (["reward_model.launch_reward_fn_async=True"], "one trainer and one rollout process"),
                         (["reward_model.enable=True", "reward_model.model.path=/rm",
                           "reward_model.enable_resource_pool=True", "reward_model.n_gpus_per_node=1"],
                          "one trainer and one rollout process")]:
        with pytest.raises(ConfigError, match=words):
            check_async(build_config(PPOConfig(), pool + extra))
    # one trainer and ONE tensor-parallel replica (no pool) gets the same TP refusals; partial rollouts run on it
    one_tp = off + ["rollout.n_gpus_per_node=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]
    check_async(build_config(PPOConfig(), one_tp))
    check_async(build_config(PPOConfig(), one_tp + ["async_training.partial_rollout=True"]))
    with pytest.raises(ConfigError, match="bypass_mode=True"):
        check_async(build_config(PPOConfig(), one_tp + ["algorithm.rollout_correction.rollout_is=token"]))
    with pytest.raises(ConfigError, match="with one replica"):  # a pool of replicas: still one engine only
        check_async(build_config(PPOConfig(), pool + ["async_training.partial_rollout=True"]))
    tp3 = build_config(PPOConfig(), pool + ["actor_rollout_ref.rollout.name=native",
                                            "actor_rollout_ref.rollout.tensor_model_parallel_size=3"])
    with pytest.raises(ConfigError, match="rollout.n_gpus_per_node=2"):
        check_tensor_parallel(tp3)


# ------------------------------------------------------------------------------------------------ weight streaming
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stream(rank: int, place: Placement, port: int, model_dir: str, out: str) -> None:
    """One process of a job that streams one weights version from the (FSDP-sharded) trainer ranks to every rollout
    process, in buckets smaller than a tensor, and saves what each side holds."""
    from polyrl.distributed.parallelize import parallelize
    from polyrl.distributed.weights import full_state_dict, full_tensors_by_layer
    from polyrl.learner.config import FSDPConfig
    from polyrl.models.loader import load_causal_lm, merged_state_dict
    from polyrl.trainer.async_ppo import join, tensor_parallel_cuts, weight_receiver, weight_sender

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    env, link = join(place, rank, device="cpu", fsdp_size=-1, timeout_s=60)
    model = load_causal_lm(model_dir)
    if place.is_trainer(rank):  # the same moved weights on every trainer rank, then sharded
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        if env.is_distributed:
            parallelize(model, env.mesh, FSDPConfig(), torch.device("cpu"))
        full = full_state_dict(model)
        sender = weight_sender(model, place, rank, link, bucket_bytes=1024)
        assert len(sender.plan) > 3 and all(len({n.split(".layers.")[-1].split(".")[0] for n in b.names
                                                  if ".layers." in n}) <= 1 for b in sender.plan)  # a layer each
        sender.send(full_tensors_by_layer(merged_state_dict(model).items()))
        sender.wait()
        if rank == 0:
            torch.save(full, out)
    else:
        tp_rank = (rank - place.num_trainers) % place.tp
        cut = tensor_parallel_cuts(model, place.tp)[tp_rank] if place.tp > 1 else None
        got = {n: t.clone() for n, t in weight_receiver(model, place, rank, link, 1024, cut).receive()}
        torch.save(got, f"{out}.{rank}")
    torch.distributed.destroy_process_group()
    os._exit(0)  # gloo threads can abort interpreter finalization (tests/test_forward_prefetch_on_cpu.py)


@pytest.mark.parametrize("place", [Placement(2, 2), Placement(2, 2, tp=2), Placement(1, 2, tp=2)],
                         ids=["2trainers-2replicas", "2trainers-tp2", "1trainer-tp2"])
def test_every_rollout_process_receives_the_trainers_weights_or_its_tp_slice(place, tmp_path, request):
    from polyrl.models.tiny import build_tiny_model
    from polyrl.trainer.async_ppo import tensor_parallel_cuts

    model_dir = build_tiny_model(tmp_path / "model", hidden_size=32, layers=2, heads=2, kv_heads=2, intermediate=64,
                                 max_position_embeddings=128)
    out = str(tmp_path / "w.pt")
    mp.start_processes(_stream, args=(place, _free_port(), str(model_dir), out), nprocs=place.world_size,
                       start_method="fork")
    full = torch.load(out)
    from polyrl.models.loader import load_causal_lm

    cuts = tensor_parallel_cuts(load_causal_lm(model_dir), place.tp) if place.tp > 1 else None
    for rank in range(place.num_trainers, place.world_size):
        got = torch.load(f"{out}.{rank}")
        assert set(got) == set(full), rank
        for name, t in got.items():
            want = cuts[(rank - place.num_trainers) % place.tp](name, full[name]) if cuts else full[name]
            assert torch.equal(t, want), (rank, name)
        if cuts:  # a TP rank holds half of a sharded projection
            up = "model.layers.0.mlp.up_proj.weight"
            assert got[up].shape[0] == full[up].shape[0] // 2


# ------------------------------------------------------------------------------------------------ jobs
@pytest.fixture(scope="module")
def kv2_model_dir(tmp_path_factory):
    from polyrl.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("pool") / "model", hidden_size=32, layers=1, heads=2, kv_heads=2,
                            intermediate=64, max_position_embeddings=128)


def _pool_job(argv: list[str], world: int, **env) -> list:
    """`polyrl train argv` as the `world` processes of one gloo job, rollout ranks first (they wait for the
    trainer), trainer rank 0 last."""
    port = str(_free_port())
    return [_process(argv, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=port, **env) for rank in reversed(range(world))]


VARYING_REWARD = ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                  "    return sum(map(ord, solution_str)) % 7 / 6\n")  # varies within groups: every step moves


def _pool_args(model_dir, data_dir, out, steps, trainers, rollouts, *extra):
    reward = out / "varying_reward.py"
    reward.parent.mkdir(parents=True, exist_ok=True)
    reward.write_text(VARYING_REWARD)
    return _args(model_dir, data_dir, out, steps, "actor_rollout_ref.hybrid_engine=False",
                 f"custom_reward_function.path={reward}",
                 f"trainer.n_gpus_per_node={trainers}", f"rollout.n_gpus_per_node={rollouts}",
                 "actor_rollout_ref.rollout.name=native", *extra)


def test_two_trainers_and_two_replicas_train_each_batch_on_the_weights_that_generated_it(kv2_model_dir,
                                                                                         synth_data_dir, tmp_path):
    """2 trainer ranks (FSDP2) + 2 rollout replicas, age 0: every batch is generated by both replicas with the
    weights the trainer holds, which the engine's log-probs show (the fp32 CPU engine is the trainer's forward up to
    rounding, and lr=1e-2 moves the weights far more than that between steps)."""
    codes, log = _wait(_pool_job(_pool_args(kv2_model_dir, synth_data_dir, tmp_path, 2, 2, 2,
                                            "async_training.max_trajectory_age_steps=0"), 4))
    assert codes == [0, 0, 0, 0], log[-4000:]
    rows = _steps(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["async/weight_version/min"] == r["async/weight_version/max"] == r["step"] - 1
        assert r["training/rollout_probs_diff_mean"] < 1e-5, r["training/rollout_probs_diff_mean"]
        assert r["actor/grad_norm"] > 0 and r["perf/total_num_tokens"] > 0
    assert rows[0]["timing_s/update_weights"] > 0  # version 1 went to both replicas (version 2 nobody needs)
    assert (tmp_path / "ckpt" / "global_step_2" / "dcp").is_dir()  # the trainer's sharded checkpoint


SLOW = pytest.mark.skipif(not os.environ.get("POLYRL_SLOW_TESTS"), reason="POLYRL_SLOW_TESTS=1: two 4-process jobs")


@pytest.mark.slow
@SLOW
def test_two_trainers_two_replicas_run_one_step_off_and_resume_after_a_replica_dies(kv2_model_dir, synth_data_dir,
                                                                                   tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(KILLING_REWARD)
    argv = _pool_args(kv2_model_dir, synth_data_dir, tmp_path, 4, 2, 2, "trainer.save_freq=2",
                      f"custom_reward_function.path={reward}")
    # each replica's leader scores 2 prompts x 4 = 8 rows a batch: both die scoring batch 3 (after step 2's
    # checkpoint); batch 2, sent before, may or may not have reached the trainer ranks by then
    codes, log = _wait(_pool_job(argv, 4, KILL_AT_SAMPLE=str(3 * 8 + 1)))
    assert all(c != 0 for c in codes), log[-4000:]
    first = _steps(tmp_path)
    done = len(first)
    assert done in (2, 3) and [r["step"] for r in first] == list(range(1, done + 1))
    errors = [line for line in log.splitlines() if line.startswith("polyrl: error:")]
    assert len(errors) == 1, log[-4000:]  # trainer rank 0 says it; rank 1 leaves quietly
    assert re.search(rf"The rollout process \(rank [23]\) stopped before batch {done}", errors[0]), errors
    assert [r["async/staleness/mean"] for r in first] == [0.0, 1.0, 1.0][:done]
    assert [r["async/weight_version/max"] for r in first] == [0, 0, 1][:done]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "2"

    codes, log = _wait(_pool_job(argv, 4))  # the same command again: resumes from step 2's checkpoint
    assert codes == [0, 0, 0, 0], log[-4000:]
    assert "resumed from" in log and "at step 2" in log
    rows = _steps(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["async/weight_version/max"] for r in rows[2:]] == [2, 2]  # batch 2 again, from step 2's weights


@pytest.mark.parametrize("trainers", [pytest.param(1, marks=[pytest.mark.slow, SLOW]), 2])
def test_a_tensor_parallel_replica_serves_the_trainer_ranks(kv2_model_dir, synth_data_dir, tmp_path, trainers):
    """One TP-2 replica (2 rollout processes, each holding half of every projection and receiving only that half)
    with 1 or 2 trainer ranks, age 0: the replica's log-probs are the trainer's forward within TP's summation
    rounding, step after step."""
    argv = _pool_args(kv2_model_dir, synth_data_dir, tmp_path, 2, trainers, 2,
                      "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                      "async_training.max_trajectory_age_steps=0")
    codes, log = _wait(_pool_job(argv, trainers + 2))
    assert codes == [0] * (trainers + 2), log[-4000:]
    rows = _steps(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["async/weight_version/max"] == r["step"] - 1
        assert r["training/rollout_probs_diff_mean"] < 1e-5, r["training/rollout_probs_diff_mean"]


def test_two_trainer_ranks_validate_on_their_shards_as_one_trainer_does(kv2_model_dir, synth_data_dir, tmp_path):
    """`data.val_files` with 2 trainer ranks: each rank validates its share of the prompts on its FSDP2 shards, the
    ranks decoding in step (rollout/hf.py `lockstep`), and the gathered metrics equal one trainer's, before training
    and after a step. One prompt: rank 1 has none and decodes a stand-in row in step with rank 0 (without lockstep
    the ranks' FSDP collectives part ways and gloo fails)."""
    from polyrl.data.dataset import write_parquet
    from polyrl.data.synthetic import make_rows

    val = tmp_path / "val3.parquet"
    write_parquet(make_rows("reverse", 1, seed=5, split="val"), val)

    def run(out, trainers):
        argv = _pool_args(kv2_model_dir, synth_data_dir, out, 1, trainers, 1,
                          "async_training.max_trajectory_age_steps=0", f"data.val_files={val}",
                          "trainer.val_before_train=True", "trainer.test_freq=1")
        codes, log = _wait(_pool_job(argv, trainers + 1))
        assert codes == [0] * (trainers + 1), log[-4000:]
        rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
        vals = [{k: v for k, v in r.items() if k.startswith("val-")} for r in rows]
        return [v for v in vals if v]

    one, two = run(tmp_path / "one", 1), run(tmp_path / "two", 2)
    assert len(one) == len(two) == 2 and one[0] and set(one[0]) == set(two[0])
    for a, b in zip(one, two):
        assert all(abs(a[k] - b[k]) < 1e-6 for k in a), (a, b)
