"""Data-parallel training on CPU (gloo): 2 processes give the 1-process run, and checkpoints cross process counts.

The 2-process job is this file run under torchrun (see `__main__` at the bottom). Rollouts are made independent of
how prompts are split by sampling each prompt with a seed derived from (step, prompt): then any difference between
1 and 2 processes comes from the distributed code (sharding, FSDP2, normalisers, weight sync), not from sampling.
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polyrl.distributed.data import merge_step_metrics, shard_evenly, shard_prompts
from polyrl.distributed.launch import torchrun_command
from polyrl.trainer.job import maybe_launch
from polyrl.rollout.base import Generation

# torch on one thread here: the 2-process jobs run beside this process's own run, and a second OpenMP thread only
# spin-waits for a core (the MoE and head-gradient tests: 91 -> 64 CPU-s)
pytestmark = pytest.mark.usefixtures("one_thread")

# ------------------------------------------------------------------------------------------------ pure functions


def test_prompt_shards_rebuild_every_single_process_mini_batch():
    num_prompts, per_mini, world = 12, 4, 2
    shards = [shard_prompts(num_prompts, per_mini, r, world) for r in range(world)]
    assert sorted(shards[0] + shards[1]) == list(range(num_prompts))
    per_rank_mini = per_mini // world
    for k in range(num_prompts // per_mini):  # rank-local mini-batch k, over all ranks == global mini-batch k
        union = sorted(i for s in shards for i in s[k * per_rank_mini:(k + 1) * per_rank_mini])
        assert union == list(range(k * per_mini, (k + 1) * per_mini))


def test_even_shards_and_metric_merge():
    assert [list(shard_evenly(5, r, 2)) for r in range(2)] == [[0, 1, 2], [3, 4]]
    merged = merge_step_metrics([{"a/max": 1.0, "a/min": 1.0, "a/mean": 1.0, "timing_s/gen": 2.0},
                                 {"a/max": 3.0, "a/min": 0.5, "a/mean": 2.0, "timing_s/gen": 5.0}])
    assert merged == {"a/max": 3.0, "a/min": 0.5, "a/mean": 1.5, "timing_s/gen": 5.0}


def test_launch_relaunches_only_when_more_processes_are_wanted(monkeypatch):
    from polyrl.trainer.config import PPOConfig

    cfg = PPOConfig()
    calls = []
    monkeypatch.setattr(subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert maybe_launch(cfg, ["a=1"]) is None and not calls  # one process: train right here
    cfg.trainer.n_gpus_per_node = 2
    assert maybe_launch(cfg, ["a=1"]) == 0
    assert calls[0][1:] == ["-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "-m",
                            "polyrl.train", "a=1"]
    monkeypatch.setenv("LOCAL_RANK", "0")  # a torchrun child never relaunches
    assert maybe_launch(cfg, ["a=1"]) is None and len(calls) == 1


class _TwoRanks:
    """`balance_across_ranks`'s view of a 2-process job, both ranks' batches held in one process."""

    world_size = 2

    def __init__(self, rank, batches):
        self.rank, self.batches, self.gathers = rank, batches, 0

    def all_gather_object(self, obj):
        self.gathers += 1
        if isinstance(obj, list):  # the token counts
            return [b["attention_mask"].sum(1).tolist() for b in self.batches]
        return [{k: v.clone() for k, v in b.items()} for b in self.batches]


def _rows(lengths, tag):
    mask = torch.zeros(len(lengths), 8, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    responses = torch.full((len(lengths), 4), tag) + torch.arange(len(lengths))[:, None]  # 4 prompt + 4 response
    return {"input_ids": torch.cat([responses, responses], 1), "attention_mask": mask, "responses": responses}


def test_balance_moves_rows_only_when_it_evens_the_load():
    from polyrl.distributed.balance import balance_across_ranks

    even = [_rows([5, 5], 0), _rows([5, 5], 10)]
    env = _TwoRanks(0, even)
    out, m = balance_across_ranks(even[0], 2, env)
    assert out is even[0] and env.gathers == 1  # only the token counts travelled
    assert m["perf/balance/max_over_mean_before"] == m["perf/balance/max_over_mean_after"] == 1.0

    skewed = [_rows([8, 8], 0), _rows([1, 1], 10)]
    outs = [balance_across_ranks(skewed[r], 2, _TwoRanks(r, skewed))[0] for r in range(2)]
    tags = sorted(int(t) for o in outs for t in o["responses"][:, 0])
    assert tags == [0, 1, 10, 11]  # every row kept, none twice
    assert [int(o["attention_mask"].sum()) for o in outs] == [9, 9]  # 16 + 2 tokens -> 9 each


# ------------------------------------------------------------------------------------------------ the trainer


class PerPromptSeeded:
    """Wraps an engine: each prompt sampled alone with seed f(step, prompt ids), so the split does not matter."""

    def __init__(self, engine, trainer):
        self.inner, self.trainer = engine, trainer
        self.model = engine.model

    def generate(self, prompt_ids, sampling):
        out = Generation(prompt_index=[], token_ids=[], logprobs=[], finish_reason=[])
        for i, p in enumerate(prompt_ids):
            seed = (self.trainer.global_step * 1_000_003 + sum((j + 1) * t for j, t in enumerate(p))) % 2**31
            r = self.inner.generate([p], dataclasses.replace(sampling, seed=seed))
            out.prompt_index += [i] * len(r.token_ids)
            out.token_ids += r.token_ids
            out.logprobs += r.logprobs
            out.finish_reason += r.finish_reason
            if r.routed_experts is not None:  # MoE routing replay: the rows' recorded routes
                out.routed_experts = (out.routed_experts or []) + r.routed_experts
        return out

    def update_weights(self, named):
        self.inner.update_weights(named)

    def release_memory(self):
        self.inner.release_memory()

    def resume(self):
        self.inner.resume()


def _args(model_dir, data_dir, out_dir, steps, *extra):
    return [
        f"data.train_files={data_dir / 'train.parquet'}",
        "data.train_batch_size=4", "data.max_prompt_length=32", "data.max_response_length=6",
        f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        # the update cuts micro-batches by tokens (ranks agree on the count, padding passes where needed); the
        # old-log-prob and reference passes keep fixed micro-batches: both paths run on 2 processes
        "actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=40",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.entropy_coeff=0.01",
        "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.n=4", "trainer.device=cpu",
        f"trainer.run_dir={out_dir / 'run'}", f"trainer.default_local_dir={out_dir / 'ckpt'}",
        f"trainer.total_training_steps={steps}", "trainer.progress_bar=False", "trainer.logger=[file]", *extra,
    ]


def _train(argv) -> "PPOTrainer":  # noqa: F821
    from polyrl.config import build_config
    from polyrl.trainer.config import PPOConfig
    from polyrl.trainer.ppo import PPOTrainer

    trainer = PPOTrainer(build_config(PPOConfig(), argv))
    trainer.engine = PerPromptSeeded(trainer.engine, trainer)
    trainer.fit()
    return trainer


def _steps(out_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out_dir / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "actor/pg_loss" in r]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "huggingface" / "model.safetensors"))


def test_two_processes_match_one_and_checkpoint_loads_at_one(tiny_model_dir, synth_data_dir, tmp_path):
    # the 2-process job: 2 GRPO steps, validation, a DCP checkpoint with HF export (this file under torchrun)
    two = tmp_path / "two"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path.cwd())}
    val = f"data.val_files={synth_data_dir / 'val.parquet'}"
    cmd = torchrun_command(2, [__file__, *_args(tiny_model_dir, synth_data_dir, two, 2, val)])
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    # meanwhile, the same 3 steps in one process
    one = tmp_path / "one"
    _train(_args(tiny_model_dir, synth_data_dir, one, 3))
    log, _ = job.communicate(timeout=240)
    assert job.returncode == 0, log[-3000:]
    ckpt2 = two / "ckpt" / "global_step_2"
    assert (ckpt2 / "dcp" / ".metadata").is_file()
    # each rank writes its own shards, one file per tensor shard (named __<rank>_<index>.distcp)
    assert {f.name.split("_")[2] for f in (ckpt2 / "dcp").glob("*.distcp")} == {"0", "1"}
    assert (two / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "2"
    ref, got = _steps(one), _steps(two)
    assert [r["step"] for r in got] == [1, 2]  # rank 0 alone logs, once per step
    for a, b in zip(ref[:2], got):
        assert a["critic/score/mean"] == b["critic/score/mean"]  # same rollouts, same rewards
        assert a["perf/total_num_tokens"] == b["perf/total_num_tokens"]  # a job total, counted once
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac"):
            assert abs(a[key] - b[key]) <= 1e-5 + 1e-4 * abs(a[key]), (key, a[key], b[key])
    assert any(k.startswith("val-core/") for k in got[-1])  # validation gathered over both ranks
    # trainer.balance_batch re-dealt rows across the ranks (and the metrics above still match one process)
    for r in got:
        assert 1.0 <= r["perf/balance/max_over_mean_after"] <= r["perf/balance/max_over_mean_before"]
    w1 = _weights(one / "ckpt" / "global_step_3")
    w2 = _weights(ckpt2)
    assert set(w1) == set(w2)

    # resume the 2-process checkpoint in ONE process and train step 3: it must land on the 1-process run's weights
    resumed = tmp_path / "resumed"
    _train(_args(tiny_model_dir, synth_data_dir, resumed, 3, "trainer.resume_mode=resume_path",
                 f"trainer.resume_from_path={ckpt2}"))
    r3, ref3 = _steps(resumed)[-1], ref[2]
    assert r3["step"] == 3 and r3["critic/score/mean"] == ref3["critic/score/mean"]
    assert abs(r3["actor/pg_loss"] - ref3["actor/pg_loss"]) <= 1e-5 + 1e-4 * abs(ref3["actor/pg_loss"])
    w3 = _weights(resumed / "ckpt" / "global_step_3")
    moved = max((w1[k] - _weights(ckpt2)[k]).abs().max() for k in w1)
    assert moved > 1e-4  # step 3 changed the weights, so matching them below means something
    for k in w1:  # Adam state came back from the shards too, or step 3 would differ
        torch.testing.assert_close(w3[k], w1[k], rtol=0, atol=5e-6)


def _beside_one_process(model_dir, data_dir, tmp_path, steps: int, extra: list[str], one_steps: int | None = None):
    """The 2-process job (this file under torchrun, in tmp_path/two) and, meanwhile, the same run in this process (in
    tmp_path/one, `one_steps` steps, default the same): the step rows of one process and of two."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path.cwd())}
    two, one = tmp_path / "two", tmp_path / "one"
    cmd = torchrun_command(2, [__file__, *_args(model_dir, data_dir, two, steps, *extra)])
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _train(_args(model_dir, data_dir, one, one_steps or steps, *extra))
    log, _ = job.communicate(timeout=240)
    assert job.returncode == 0, log[-3000:]
    return _steps(one), _steps(two)


def test_two_processes_match_one_with_the_head_gradient_in_the_forward(tiny_model_dir, synth_data_dir, tmp_path):
    """The on-policy single pass (one mini-batch, no KL loss: the LM head's backward runs in its forward) under FSDP2
    on 2 processes gives one process's step."""
    extra = ["actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.use_kl_loss=False"]
    (a,), (b,) = _beside_one_process(tiny_model_dir, synth_data_dir, tmp_path, 1, extra)
    assert a["training/old_log_prob_source_current"] == b["training/old_log_prob_source_current"] == 1.0
    assert a["critic/score/mean"] == b["critic/score/mean"]
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert abs(a[key] - b[key]) <= 1e-5 + 1e-4 * abs(a[key]), (key, a[key], b[key])
    assert a["actor/grad_norm"] > 0


def _varied_reward(tmp_path: Path, modulus: int) -> str:
    """A custom reward a random model's samples vary on (1 where the response's character codes sum to a multiple
    of `modulus`), as the key that selects it."""
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      f"    return float(sum(map(ord, solution_str)) % {modulus} == 0)\n")
    return f"custom_reward_function.path={reward}"


def test_two_processes_match_one_with_a_critic_and_the_checkpoint_resumes_in_one(tiny_model_dir, synth_data_dir,
                                                                                   tmp_path):
    """PPO with a critic (gae) on 2 processes: the value model FSDP2-sharded like the actor, its loss normalised over
    both ranks, the advantages whitened with the whole batch's statistics; the same values, advantages and updates
    as one process. The sharded checkpoint (actor and critic) resumes in one process and continues as one process
    does."""
    extra = ["algorithm.adv_estimator=gae", "critic.optim.lr=1e-2", "critic.ppo_micro_batch_size_per_gpu=2",
             "actor_rollout_ref.actor.use_kl_loss=False", _varied_reward(tmp_path, 3)]
    ref, got = _beside_one_process(tiny_model_dir, synth_data_dir, tmp_path, 2, extra, one_steps=3)
    assert [r["step"] for r in got] == [1, 2]
    assert ref[1]["critic/vf_loss"] != ref[0]["critic/vf_loss"]  # the critic trained: matching it means something
    for a, b in zip(ref[:2], got):
        assert a["critic/score/mean"] == b["critic/score/mean"]
        for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/values/mean",
                    "critic/advantages/max", "critic/advantages/min", "actor/pg_loss", "actor/grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 + 1e-4 * abs(a[key]), (key, a[key], b[key])
    resumed = tmp_path / "resumed"  # the 2-process checkpoint of step 2, resumed by one process for step 3
    _train(_args(tiny_model_dir, synth_data_dir, resumed, 3, *extra, "trainer.resume_mode=resume_path",
                 f"trainer.resume_from_path={tmp_path / 'two' / 'ckpt' / 'global_step_2'}"))
    r3, ref3 = _steps(resumed)[-1], ref[2]
    assert r3["step"] == 3
    for key in ("critic/vf_loss", "critic/values/mean", "actor/pg_loss"):  # the critic's weights and Adam came back
        assert abs(r3[key] - ref3[key]) <= 1e-5 + 1e-4 * abs(ref3[key]), (key, r3[key], ref3[key])


def test_two_processes_match_one_with_dapo_dynamic_sampling(tiny_model_dir, synth_data_dir, tmp_path):
    """DAPO dynamic sampling (filter_groups, a generation batch twice the train batch) on 2 processes: ranks keep
    different numbers of groups, so the kept groups are gathered and dealt as one process would train them; the
    same rounds, rewards and update as one process."""
    extra = ["algorithm.filter_groups.enable=True", "algorithm.filter_groups.max_num_gen_batches=20",
             "data.gen_batch_size=8", _varied_reward(tmp_path, 7), "actor_rollout_ref.rollout.n=3",
             "actor_rollout_ref.rollout.temperature=1.5", "actor_rollout_ref.actor.use_kl_loss=False"]
    ref, got = _beside_one_process(tiny_model_dir, synth_data_dir, tmp_path, 2, extra)
    assert [r["step"] for r in got] == [1, 2]
    assert max(r["train/num_gen_batches"] for r in got) >= 2  # a step drew again: the job-wide count decided it
    for a, b in zip(ref, got):
        assert a["train/num_gen_batches"] == b["train/num_gen_batches"]
        assert b["critic/rewards/zero_std_ratio"] == 0.0  # every trained group has a learning signal
        assert abs(a["critic/score/mean"] - b["critic/score/mean"]) < 1e-6  # the same groups trained
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 + 1e-4 * abs(a[key]), (key, a[key], b[key])


def test_two_processes_match_one_under_lora_with_the_native_engine(tiny_model_dir, synth_data_dir, tmp_path):
    """LoRA under FSDP2 on 2 processes, the native engine on each rank's host replica: each sync all-gathers only the
    merged adapted weights (`merged_state_dict(trained_only=True)`), so step 2's rollouts, sampled after the first
    sync, equal one process's only if that sync carried every changed weight."""
    extra = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
             "actor_rollout_ref.actor.optim.lr=2e-2", "actor_rollout_ref.rollout.name=native"]
    one, two = _beside_one_process(tiny_model_dir, synth_data_dir, tmp_path, 2, extra)
    assert [r["step"] for r in two] == [1, 2]
    for a, b in zip(one, two):
        assert a["critic/score/mean"] == b["critic/score/mean"]
        assert a["response_length/mean"] == b["response_length/mean"]
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 + 1e-4 * abs(a[key]), (key, a[key], b[key])
    w1, w2 = (_weights(tmp_path / run / "ckpt" / "global_step_2") for run in ("one", "two"))
    assert w1.keys() == w2.keys()
    for k in w1:  # the merged exports agree
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=5e-6)


@pytest.mark.slow
def test_two_processes_match_one_on_a_moe_with_rollout_routing_replay(synth_data_dir, tmp_path):
    """A tiny Qwen3-MoE under FSDP2 (per-decoder-layer units, experts' 3-D tensors sharded) on 2 processes, routes
    recorded by the hf rollout and replayed (R3): one process's step."""
    from polyrl.models.tiny import build_tiny_model

    moe = build_tiny_model(tmp_path / "moe", arch="qwen3_moe", hidden_size=32, layers=2, heads=2, kv_heads=1,
                           intermediate=64, max_position_embeddings=128)
    extra = ["actor_rollout_ref.actor.router_replay.mode=R3",
             "actor_rollout_ref.rollout.enable_rollout_routing_replay=True"]
    (a,), (b,) = _beside_one_process(moe, synth_data_dir, tmp_path, 1, extra)
    assert a["critic/score/mean"] == b["critic/score/mean"]
    assert a["actor/router_agreement"] > 0.95 and abs(a["actor/router_agreement"] - b["actor/router_agreement"]) < 1e-6
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert abs(a[key] - b[key]) <= 1e-5 + 1e-4 * abs(a[key]), (key, a[key], b[key])
    w1, w2 = (_weights(tmp_path / run / "ckpt" / "global_step_1") for run in ("one", "two"))
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=5e-6)


# ------------------------------------------------------------------------------------------------ Ray


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    from polyrl.distributed.ray_cluster import init_ray

    init_ray(num_cpus=4)  # logical CPUs: the reward actor and trainer-side tasks fit on a 2-core machine
    yield ray
    ray.shutdown()


def test_reward_worker_scores_apart_from_the_trainer(ray_local):
    from polyrl.rewards import RewardManager, build_reward_fn
    from polyrl.rewards.config import CustomRewardConfig, OverlongBufferConfig
    from polyrl.rewards.remote import RemoteReward

    overlong = OverlongBufferConfig(enable=True, len=4, penalty_factor=1.0, log=True)
    samples = [("polyrl/reverse", "cba", "cba", {}), ("polyrl/reverse", "abc", "cba", {}),
               ("polyrl/reverse", "cb", "cba", {})]
    lengths = [3, 8, 7]
    local = RewardManager(build_reward_fn(CustomRewardConfig()), overlong_buffer=overlong, max_response_length=8)
    remote = RemoteReward(CustomRewardConfig(), overlong, 8)
    assert ray_local.get(remote.actor.pid.remote()) != os.getpid()  # a separate process
    assert remote.score(samples, response_lengths=lengths) == local.score(samples, response_lengths=lengths)
    assert remote.score(samples, response_lengths=lengths)[0][1] < 0  # the overlong penalty was applied there


def test_trainer_uses_the_ray_reward_worker(ray_local, tiny_model_dir, synth_data_dir, tmp_path):
    from polyrl.config import build_config
    from polyrl.rewards.remote import RemoteReward
    from polyrl.trainer.config import PPOConfig
    from polyrl.trainer.ppo import PPOTrainer

    trainer = PPOTrainer(build_config(PPOConfig(), _args(tiny_model_dir, synth_data_dir, tmp_path, 1,
                                                         "reward_model.launch_reward_fn_async=True")))
    assert isinstance(trainer.reward, RemoteReward)
    metrics = trainer.step()
    assert 0.0 <= metrics["critic/score/mean"] <= 1.0 and metrics["timing_s/reward"] > 0


def test_reward_gpus_are_shared_by_a_nodes_ranks(monkeypatch):
    from polyrl.rewards.remote import reward_gpus_per_rank
    from polyrl.errors import ConfigError

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert reward_gpus_per_rank(2, "k") == 0.5 and reward_gpus_per_rank(0, "k") == 0.0
    with pytest.raises(ConfigError, match="reward_model.n_gpus_per_node=-1 must be >= 0"):
        reward_gpus_per_rank(-1, "reward_model.n_gpus_per_node")


def test_reward_resource_pool_gives_the_ray_worker_gpus(monkeypatch, tiny_model_dir, synth_data_dir, tmp_path):
    """reward_model.enable_resource_pool: each rank's reward actor asks for n_gpus_per_node / ranks per node."""
    import polyrl.rewards.remote as rc
    from polyrl.config import build_config
    from polyrl.trainer.config import PPOConfig
    from polyrl.trainer.ppo import PPOTrainer

    asked = []
    monkeypatch.setattr(rc, "RemoteReward", lambda *a, num_gpus=0, **k: asked.append(num_gpus))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    keys = ["reward_model.launch_reward_fn_async=True", "reward_model.enable_resource_pool=True",
            "reward_model.n_gpus_per_node=1"]  # fmt: skip
    for chosen in (keys, keys[:1], keys[1:]):
        PPOTrainer(build_config(PPOConfig(), _args(tiny_model_dir, synth_data_dir, tmp_path, 1, *chosen)))
    assert asked == [0.5, 0, 0.5]  # half of the node's reward GPU per rank; no pool: a CPU actor; the pool alone
    # implies the Ray worker


@pytest.mark.skipif(not os.environ.get("POLYRL_SLOW_TESTS"), reason="~40 s; set POLYRL_SLOW_TESTS=1")
def test_two_node_recipe_on_one_machine(ray_local, tiny_model_dir, synth_data_dir, tmp_path):
    """trainer.nnodes=2 through Ray: two torchrun agents (SPREAD lets both bundles sit on this one machine)."""
    from polyrl.config import build_config
    from polyrl.distributed.launch import launch_on_ray
    from polyrl.trainer.config import PPOConfig
    from polyrl.trainer.job import launch_job

    argv = _args(tiny_model_dir, synth_data_dir, tmp_path, 1, "trainer.nnodes=2", "trainer.n_gpus_per_node=1")
    os.environ["PYTHONPATH"] = str(Path.cwd())
    assert launch_on_ray(launch_job(build_config(PPOConfig(), argv)), argv, strategy="SPREAD") == 0
    assert (tmp_path / "ckpt" / "global_step_1" / "dcp" / ".metadata").is_file()
    assert len(list((tmp_path / "ckpt" / "global_step_1" / "dcp").glob("*.distcp"))) == 2  # 2 ranks wrote shards
    assert [r["step"] for r in _steps(tmp_path)] == [1]


if __name__ == "__main__":  # one rank of the 2-process job
    from polyrl.distributed.launch import exit_child

    _train(sys.argv[1:]).dist.finish()  # tear down together: rank 0 still writes files after the last collective
    exit_child(0)
