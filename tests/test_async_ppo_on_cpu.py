"""The one-step off-policy pipeline (polyrl/trainer/async_ppo.py) on CPU: 2 processes over gloo, 1 trainer + 1 rollout.

Jobs are started as two plain processes (RANK/WORLD_SIZE/MASTER_* set here, as torchrun would) so that a rollout
process that dies leaves the trainer alive to say so, which is what the kill test checks.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from polyrl.algorithms.rollout_correction import RolloutCorrectionConfig
from polyrl.distributed.p2p import WeightReceiver, WeightSender, bucket_plan, tensor_spec
from polyrl.trainer.async_ppo import behaviour_source, staleness_metrics, weight_versions_needed


# ------------------------------------------------------------------------------------------------ pure functions
def test_bucket_plan_keeps_order_splits_by_size_and_dtype():
    spec = [("a", torch.Size([4]), torch.float32), ("b", torch.Size([2, 2]), torch.float32),
            ("c", torch.Size([8]), torch.float32), ("d", torch.Size([2]), torch.bfloat16)]
    plan = bucket_plan(spec, bucket_bytes=32)  # a+b fill 32 bytes; c alone; d changes dtype
    assert [b.names for b in plan] == [("a", "b"), ("c",), ("d",)]
    assert [b.numel for b in plan] == [8, 8, 2]


def test_schedule_and_staleness_metrics():
    assert weight_versions_needed(total_steps=5, max_age=1) == 3  # batch 4 is generated with version 3
    assert weight_versions_needed(total_steps=5, max_age=0) == 4
    m = staleness_metrics([2, 2, 3, 3], trained_version=3, max_age=1)
    assert m["async/staleness/mean"] == 0.5 and m["async/staleness/max"] == 1.0
    assert m["async/staleness/frac_0"] == m["async/staleness/frac_1"] == 0.5


def test_behaviour_source_is_the_engine_unless_decoupled_correction_needs_the_trainers_precision():
    plain, tis = RolloutCorrectionConfig(), RolloutCorrectionConfig(rollout_is="token")
    bypass = RolloutCorrectionConfig(rollout_is="token", bypass_mode=True)
    assert [behaviour_source(plain, stale=s) for s in (False, True)] == ["current", "engine"]
    assert [behaviour_source(tis, stale=s) for s in (False, True)] == ["current", "recomputed"]
    assert [behaviour_source(bypass, stale=s) for s in (False, True)] == ["engine", "engine"]


def test_partial_rollouts_continue_capped_rows_and_ship_finished_groups_oldest_first():
    from types import SimpleNamespace

    from polyrl.rollout.base import Generation
    from polyrl.trainer.partial_rollout import PartialRollouts, as_part

    lengths = {"a": [2, 7], "b": [3, 3], "c": [1, 9]}  # each row's own length (it would stop there), max 8

    def engine(prompts, caps):  # emits the row's next tokens up to its cap; "stop" where its length ends
        toks, reasons = [], []
        for p, cap in zip(prompts, caps):
            name, row, have = p[0], p[1], len(p) - 2
            left = min(lengths[name][row], 8) - have
            toks.append(list(range(have, have + min(left, cap))))
            reasons.append("stop" if left <= cap and lengths[name][row] <= 8 else "length")
        return Generation(prompt_index=list(range(len(prompts))), token_ids=toks,
                          logprobs=[[-0.5] * len(t) for t in toks], finish_reason=reasons)

    class Pool(PartialRollouts):  # each row's prompt names its group and row, so the fake engine can answer
        def requests(self):
            prompts, rows, caps = super().requests()
            ids = [[g.sample.prompt_ids[0], g.rows.index(r)] + r.tokens for g in self.groups for r in g.rows
                   if not r.done]
            return ids, rows, caps

    pool = Pool(n=2, max_response_length=8, max_new_tokens=3)
    pool.add([SimpleNamespace(prompt_ids=[n]) for n in ("a", "b")], {"draw": 0})
    prompts, rows, caps = pool.requests()
    assert caps == [3, 3, 3, 3]
    pool.absorb(engine(prompts, caps), rows, caps, version=0)
    assert pool.num_done() == 1 and [g.sample.prompt_ids[0] for g in pool.take(5)] == ["b"]  # a's 2nd row: 3 of 7
    assert pool.resume_state() == {"draw": 0}
    pool.add([SimpleNamespace(prompt_ids=["c"])], {"draw": 1})
    prompts, rows, caps = pool.requests()
    pool.absorb(engine(prompts, caps), rows, caps, version=1)
    assert pool.num_done() == 0  # a: 6 of 7, c: 3 of 8 (its cap is the response length)
    for version in (2, 3):
        prompts, rows, caps = pool.requests()
        pool.absorb(engine(prompts, caps), rows, caps, version=version)
    a, c = pool.take(5)
    assert [r.tokens for r in a.rows] == [[0, 1], list(range(7))] and a.rows[1].finish_reason == "stop"
    assert (a.rows[1].first_version, a.rows[1].last_version) == (0, 2)  # tagged with both versions
    assert [len(r.tokens) for r in c.rows] == [1, 8] and c.rows[1].finish_reason == "length"  # cut at the limit
    assert pool.resume_state() is None
    prompts, out = as_part([a, c])
    assert out.prompt_index == [0, 0, 1, 1] and len(out.logprobs[1]) == 7


# ------------------------------------------------------------------------------------------------ weight streaming
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stream_weights(rank: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    from polyrl.models.loader import load_causal_lm

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(rank)
    model = load_causal_lm(model_dir)
    if rank == 0:  # the trainer: weights moved away from the checkpoint, sent in buckets smaller than one tensor
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        plan = bucket_plan(tensor_spec(model.state_dict().items()), bucket_bytes=1024)
        sender = WeightSender(dist.group.WORLD, [(1, None)], plan)
        sender.send(model.state_dict().items())
        sender.wait()
        torch.save(model.state_dict(), out)
    else:  # the rollout: starts from the checkpoint, receives in place
        params = model.state_dict()
        receiver = WeightReceiver(dist.group.WORLD, 0, bucket_plan(tensor_spec(params.items()), bucket_bytes=1024),
                                  device=torch.device("cpu"))
        assert len(receiver.plan) > 3
        with torch.no_grad():
            for name, t in receiver.receive():
                params[name].copy_(t)
        torch.save(model.state_dict(), out + ".rollout")
    dist.destroy_process_group()
    os._exit(0)  # as tests/test_forward_prefetch_on_cpu.py: gloo threads can abort interpreter finalization


def test_rollout_weights_after_sync_equal_the_trainers(tiny_model_dir, tmp_path):
    out = str(tmp_path / "w.pt")
    mp.start_processes(_stream_weights, args=(_free_port(), str(tiny_model_dir), out), nprocs=2, start_method="fork")
    sent, got = torch.load(out), torch.load(out + ".rollout")
    assert set(sent) == set(got)
    for k in sent:
        assert torch.equal(sent[k], got[k]), k


# ------------------------------------------------------------------------------------------------ 2-process jobs
def _args(model_dir: Path, data_dir: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return [
        f"data.train_files={data_dir / 'train.parquet'}",
        "data.train_batch_size=4", "data.max_prompt_length=32", "data.max_response_length=6",
        f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.n=4", "trainer.device=cpu",
        f"trainer.run_dir={out / 'run'}", f"trainer.default_local_dir={out / 'ckpt'}",
        f"trainer.total_training_steps={steps}", "trainer.progress_bar=False", "trainer.logger=[file]", *extra,
    ]


def _process(argv: list[str], **env) -> subprocess.Popen:
    """`polyrl train argv` in a process of its own (one thread: the same float sums in every process)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path.cwd()), **env}
    return subprocess.Popen([sys.executable, "-m", "polyrl.train", *argv], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _job(argv: list[str], **env) -> list[subprocess.Popen]:
    """`polyrl train argv` as the 2 processes of one gloo job: [rollout (rank 1), trainer (rank 0)]."""
    port = str(_free_port())
    return [_process(argv, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=port, **env) for rank in (1, 0)]


def _wait(procs, timeout=240) -> tuple[list[int], str]:
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    return [p.returncode for p in procs], "\n".join(logs)


def _steps(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "actor/pg_loss" in r]


def test_age_zero_equals_the_on_policy_trainer_bit_for_bit(tiny_model_dir, synth_data_dir, tmp_path):
    from safetensors.torch import load_file

    steps = 2
    job = _job(_args(tiny_model_dir, synth_data_dir, tmp_path / "async", steps,
                     "actor_rollout_ref.hybrid_engine=False", "async_training.max_trajectory_age_steps=0"))
    job.append(_process(_args(tiny_model_dir, synth_data_dir, tmp_path / "sync", steps)))
    codes, log = _wait(job)
    assert codes == [0, 0, 0], log[-4000:]
    ref, got = _steps(tmp_path / "sync"), _steps(tmp_path / "async")
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    for a, b in zip(ref, got):
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy",
                    "training/rollout_probs_diff_mean", "response_length/mean"):
            assert a[key] == b[key], (key, a[key], b[key])
        assert b["async/staleness/max"] == 0.0 and b["async/weight_version/min"] == b["step"] - 1
    w_ref = load_file(str(tmp_path / "sync" / "ckpt" / f"global_step_{steps}" / "model.safetensors"))
    w_got = load_file(str(tmp_path / "async" / "ckpt" / f"global_step_{steps}" / "model.safetensors"))
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    assert max((w_ref[k] - base[k]).abs().max() for k in base) > 1e-4  # training moved them: equality means much
    for k in w_ref:
        assert torch.equal(w_ref[k], w_got[k]), k


def test_lora_at_age_zero_equals_the_on_policy_lora_trainer_bit_for_bit(tiny_model_dir, synth_data_dir, tmp_path):
    """LoRA in the off-policy pipeline: the trainer streams merged weights and the rollout process holds the plain
    model; at age 0 every step equals the colocated LoRA trainer's, and the adapters are what was trained."""
    from safetensors.torch import load_file

    lora = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
            "actor_rollout_ref.actor.entropy_coeff=0.05"]  # a gradient whatever the rewards
    job = _job(_args(tiny_model_dir, synth_data_dir, tmp_path / "async", 2, *lora,
                     "actor_rollout_ref.hybrid_engine=False", "async_training.max_trajectory_age_steps=0"))
    job.append(_process(_args(tiny_model_dir, synth_data_dir, tmp_path / "sync", 2, *lora)))
    codes, log = _wait(job)
    assert codes == [0, 0, 0], log[-4000:]
    ref, got = _steps(tmp_path / "sync"), _steps(tmp_path / "async")
    assert [r["step"] for r in got] == [1, 2]
    for a, b in zip(ref, got):  # step 2's rollout used the weights streamed after step 1
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "training/rollout_probs_diff_mean",
                    "response_length/mean"):
            assert a[key] == b[key], (key, a[key], b[key])
    w_ref, w_got = (load_file(str(tmp_path / run / "ckpt" / "global_step_2" / "model.safetensors"))
                    for run in ("sync", "async"))
    assert w_ref.keys() == w_got.keys() and all(".lora_" in k for k in w_ref)
    assert any(w_ref[k].abs().max() > 0 for k in w_ref if "lora_B" in k)  # the adapters trained
    for k in w_ref:
        assert torch.equal(w_ref[k], w_got[k]), k


def test_stale_batches_train_against_the_engine_log_probs_unless_rollout_correction_asks_for_a_pass(
        tiny_model_dir, synth_data_dir, tmp_path):
    """By default a stale batch's pi_old is the engine's log-probs (no behaviour pass); decoupled rollout correction
    recomputes it at the trainer's precision on the rollout process. The updates agree (on CPU the fp32 engine's
    log-probs are the trainer's forward up to float rounding, and the IS weights are ~1)."""
    reward = tmp_path / "reward.py"  # varies within every group, so each step moves the weights
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return sum(map(ord, solution_str)) % 7 / 6\n")
    steps, args = 3, ("actor_rollout_ref.hybrid_engine=False", f"custom_reward_function.path={reward}")
    job = _job(_args(tiny_model_dir, synth_data_dir, tmp_path / "recompute", steps, *args,
                     "algorithm.rollout_correction.rollout_is=token"))
    job += _job(_args(tiny_model_dir, synth_data_dir, tmp_path / "engine", steps, *args))
    codes, log = _wait(job)
    assert codes == [0, 0, 0, 0], log[-4000:]
    ref, got = _steps(tmp_path / "recompute"), _steps(tmp_path / "engine")
    assert [r["async/staleness/max"] for r in got] == [0.0, 1.0, 1.0]
    assert all("timing_s/behaviour_log_prob" not in r for r in got)
    assert got[0]["training/old_log_prob_source_current"] == 1
    assert all("training/rollout_probs_diff_mean" not in r for r in got[1:])  # pi_old is the engine's: no gap
    assert all("timing_s/behaviour_log_prob" in r for r in ref[1:])
    assert all(r["training/rollout_probs_diff_mean"] < 1e-5 for r in ref)  # the generating weights' log-probs
    for a, b in zip(ref[1:], got[1:]):  # stale batches: a ratio that is not 1, the same in both runs
        assert abs(a["actor/ppo_kl"]) > 1e-3, a["actor/ppo_kl"]
        for key in ("actor/ppo_kl", "actor/pg_loss", "actor/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-6), (key, a[key], b[key])


def test_partial_rollouts_train_on_rows_from_two_weight_versions(tiny_model_dir, synth_data_dir, tmp_path):
    """partial_rollout=True with a cap of 2 of 6 response tokens: rows continue across generation calls (and weight
    versions), batches ship finished groups, pi_old is the engine's, and the run trains to the end."""
    args = ("actor_rollout_ref.hybrid_engine=False", "async_training.partial_rollout=True",
            "async_training.partial_rollout_max_new_tokens=2", "actor_rollout_ref.rollout.ignore_eos=True")
    codes, log = _wait(_job(_args(tiny_model_dir, synth_data_dir, tmp_path, 4, *args)))
    assert codes == [0, 0], log[-4000:]
    rows = _steps(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["response_length/mean"] == 6 for r in rows)  # every shipped row finished (ignore_eos: at 6)
    assert all(r["async/partial_rollout/gen_calls"] >= 1 for r in rows)
    assert rows[0]["async/partial_rollout/gen_calls"] == 3  # the first batch: 3 calls of 2 tokens
    later = rows[1:]
    assert max(r["async/partial_rollout/frac_rows_resumed"] for r in later) > 0
    assert max(r["async/partial_rollout/version_span_max"] for r in later) >= 1
    assert all(r["async/partial_rollout/rows_continued_on_kept_cache"] > 0 for r in rows)  # native engine: no prefill
    assert max(r["async/staleness/max"] for r in later) >= 1
    assert all("timing_s/behaviour_log_prob" not in r for r in rows)


KILLING_REWARD = '''
import os

from polyrl.rewards.rule import default_compute_score

calls = 0


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """The built-in score; the process dies abruptly at sample KILL_AT_SAMPLE (the rollout process scores)."""
    global calls
    calls += 1
    if calls == int(os.environ.get("KILL_AT_SAMPLE", "0")):
        os._exit(9)
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
'''


def test_one_step_off_policy_tags_versions_and_resumes_after_the_rollout_dies(tiny_model_dir, synth_data_dir,
                                                                              tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(KILLING_REWARD)
    argv = _args(tiny_model_dir, synth_data_dir, tmp_path, 5, "actor_rollout_ref.hybrid_engine=False",
                 "trainer.save_freq=2", f"custom_reward_function.path={reward}")
    # batches hold 16 samples: the rollout process dies scoring batch 3 (after step 2's checkpoint); batch 2, sent
    # before, may or may not have reached the trainer by then (a send completes when the receiver takes it)
    codes, log = _wait(_job(argv, KILL_AT_SAMPLE=str(3 * 16 + 1)))
    assert codes[0] != 0 and codes[1] != 0, log[-4000:]
    first = _steps(tmp_path)
    done = len(first)
    assert done in (2, 3) and [r["step"] for r in first] == list(range(1, done + 1))
    assert f"The rollout process (rank 1) stopped before batch {done}" in log and "rerun the same command" in log, \
        log[-4000:]
    # one step off: batch 0 comes from the initial weights, batch 1 too (generated while step 1 trained), batch 2
    # from step 1's weights
    assert [r["async/weight_version/max"] for r in first] == [0, 0, 1][:done]
    assert [r["async/staleness/mean"] for r in first] == [0.0, 1.0, 1.0][:done]
    assert first[1]["async/staleness/frac_1"] == 1.0 and first[0]["training/old_log_prob_source_current"] == 1
    for r in first:
        for key in ("timing_s/exposed_generation", "timing_s/update_weights", "timing_s/gen", "timing_s/rollout_idle"):
            assert key in r, key
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "2"

    codes, log = _wait(_job(argv))  # the same command again: resumes from step 2's checkpoint
    assert codes == [0, 0], log[-4000:]
    assert "resumed from" in log and "at step 2" in log
    rows = _steps(tmp_path)  # a resumed run drops its metrics rows past the checkpoint (step 3 when done == 3)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["async/weight_version/max"] for r in rows[2:]] == [2, 2, 3]  # batch 2 again, from step 2's weights
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "5"


def test_quickstart_learns_one_step_off_policy(tmp_path, monkeypatch, quickstart_cache):
    """`polyrl quickstart actor_rollout_ref.hybrid_engine=False`, 12 GRPO steps on 2 processes (torchrun), generation
    one step behind: the reward rises and held-out greedy accuracy gains as much as the on-policy quickstart test asks
    of 20 steps (20 points)."""
    from polyrl.trainer.quickstart import FAST, QuickstartSettings, run_quickstart

    monkeypatch.setenv("POLYRL_CACHE", str(quickstart_cache))  # the on-policy quickstart test's SFT model
    s = QuickstartSettings(**{**FAST, "grpo_steps": 12})
    r = run_quickstart(str(tmp_path / "qs"), settings=s, extra_overrides=["actor_rollout_ref.hybrid_engine=False"])
    assert r["accuracy_after"] - r["accuracy_before"] >= 0.20, r
    assert (Path(r["hf_model"]) / "config.json").is_file()
    rows = [json.loads(line) for line in (tmp_path / "qs" / "metrics.jsonl").read_text().splitlines()]
    scores = [r["critic/score/mean"] for r in rows if "critic/score/mean" in r]
    assert len(scores) == s.grpo_steps
    assert sum(scores[-4:]) / 4 - sum(scores[:4]) / 4 >= 0.1, scores
    assert max(r.get("async/staleness/max", 0) for r in rows) == 1.0


def test_quickstart_learns_with_partial_rollouts(tmp_path, monkeypatch, quickstart_cache):
    """The same 12 off-policy steps with partial rollouts capped at 4 of the 8 response tokens: answers longer than
    the cap finish in the next call (with the next weights), and learning holds."""
    from polyrl.trainer.quickstart import FAST, QuickstartSettings, run_quickstart

    monkeypatch.setenv("POLYRL_CACHE", str(quickstart_cache))
    s = QuickstartSettings(**{**FAST, "grpo_steps": 12})
    r = run_quickstart(str(tmp_path / "qs"), settings=s, extra_overrides=[
        "actor_rollout_ref.hybrid_engine=False", "async_training.partial_rollout=True",
        "async_training.partial_rollout_max_new_tokens=4"])
    assert r["accuracy_after"] - r["accuracy_before"] >= 0.20, r
    rows = [json.loads(line) for line in (tmp_path / "qs" / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("async/partial_rollout/frac_rows_resumed", 0) for r in rows) > 0


def test_pipeline_keys_are_refused_when_they_cannot_apply():
    from polyrl.config import build_config
    from polyrl.errors import ConfigError
    from polyrl.trainer.async_config import check_async
    from polyrl.trainer.config import PPOConfig

    for argv, words in [(["async_training.max_trajectory_age_steps=2"], "hybrid_engine=False"),
                        (["actor_rollout_ref.hybrid_engine=False", "async_training.partial_rollout=True",
                          "algorithm.rollout_correction.rollout_is=token"], "bypass_mode=True"),
                        (["actor_rollout_ref.hybrid_engine=False", "async_training.partial_rollout=True",
                          "data.max_response_length=64", "async_training.partial_rollout_max_new_tokens=65"],
                         "partial_rollout_max_new_tokens=65"),
                        (["actor_rollout_ref.hybrid_engine=False", "rollout.n_gpus_per_node=2",
                          "async_training.partial_rollout=True"], "with one replica"),
                        (["actor_rollout_ref.hybrid_engine=False", "actor_rollout_ref.model.lora_rank=8",
                          "actor_rollout_ref.model.lora_adapter_path=/x"], "lora_adapter_path")]:
        with pytest.raises(ConfigError, match=words):
            check_async(build_config(PPOConfig(), argv))
    check_async(build_config(PPOConfig(), ["actor_rollout_ref.hybrid_engine=False"]))  # the plain switch passes
    check_async(build_config(PPOConfig(), ["actor_rollout_ref.hybrid_engine=False",
                                           "async_training.partial_rollout=True"]))


def test_launch_counts_the_rollout_process():
    from polyrl.config import build_config
    from polyrl.trainer.job import processes_wanted
    from polyrl.trainer.config import PPOConfig

    assert processes_wanted(build_config(PPOConfig(), [])) == 1
    assert processes_wanted(build_config(PPOConfig(), ["actor_rollout_ref.hybrid_engine=False"])) == 2


def test_the_pipeline_spans_hosts_when_this_one_has_too_few_gpus(monkeypatch):
    """2 GPUs here: both processes on this host (torchrun). 1 GPU: one process per node through Ray (trainer on the
    first, rollout on the second). CPU: always here."""
    from polyrl.config import build_config
    from polyrl.trainer.config import PPOConfig
    from polyrl.trainer.job import launch_job

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    off = ["actor_rollout_ref.hybrid_engine=False", "trainer.device=cuda"]
    for gpus, nodes, per_node in ((2, 1, 2), (8, 1, 2), (1, 2, 1), (0, 2, 1)):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        job = launch_job(build_config(PPOConfig(), off))
        assert (job.nnodes, job.num_processes, job.num_processes // job.nnodes) == (nodes, 2, per_node), gpus
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert launch_job(build_config(PPOConfig(), off[:1] + ["trainer.device=cpu"])).nnodes == 1
    assert launch_job(build_config(PPOConfig(), ["trainer.device=cuda"])).num_processes == 1  # colocated: as before


def test_the_pipeline_runs_across_two_ray_nodes(tiny_model_dir, synth_data_dir, tmp_path):
    """The 1 + 1 pipeline as two torchrun agents placed by Ray, one per node (SPREAD lets both sit on this machine):
    the trainer trains on batches the other node generated, one step off."""
    ray = pytest.importorskip("ray")
    from polyrl.distributed.launch import Job, launch_on_ray
    from polyrl.distributed.ray_cluster import init_ray

    argv = _args(tiny_model_dir, synth_data_dir, tmp_path, 3, "actor_rollout_ref.hybrid_engine=False")
    os.environ["PYTHONPATH"] = str(Path.cwd())
    init_ray(num_cpus=4)
    try:
        assert launch_on_ray(Job(nproc_per_node=1, nnodes=2, device="cpu"), argv, strategy="SPREAD") == 0
    finally:
        ray.shutdown()
    rows = _steps(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["async/staleness/mean"] for r in rows] == [0.0, 1.0, 1.0]


def test_an_error_in_the_rollout_process_reaches_the_trainer_as_one_sentence(tiny_model_dir, synth_data_dir,
                                                                              tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    raise ValueError('no score today')\n")
    argv = _args(tiny_model_dir, synth_data_dir, tmp_path, 1, "actor_rollout_ref.hybrid_engine=False",
                 f"custom_reward_function.path={reward}")
    (rollout_code, trainer_code), log = _wait(_job(argv))
    assert rollout_code != 0 and trainer_code != 0
    last = [line for line in log.splitlines() if line.startswith("polyrl: error: The rollout process failed")]
    assert len(last) == 1 and "batch 0" in last[0] and "no score today" in last[0], log[-3000:]



SLOW_RM_REWARD = '''
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None, rm_score=0.0):
    time.sleep(0.05)  # 16 samples a batch: 0.8 s, longer than generating one
    return rm_score
'''


@pytest.mark.slow  # 3 processes start and import torch: 87 s on a 2-core box at load 8 (the 1-process error test: 59)
def test_a_reward_model_of_its_own_scores_behind_the_next_generation(tiny_model_dir, synth_data_dir, tmp_path):
    """enable_resource_pool without Ray: the classifier and the (slow) custom function run in a process spawned on
    this host (on the CPU here, n_gpus_per_node=0); the rollout process hands each batch to it and generates the next
    meanwhile (trainer/scoring_behind.py). Batch 0's scoring spans batch 1's whole generation, and timing_s/reward
    splits into the model, the function and the round trip."""
    from polyrl.models.tiny_reward import save_tiny

    save_tiny(tmp_path / "rm", "LlamaForSequenceClassification", seed=0, num_labels=1)
    reward = tmp_path / "reward.py"
    reward.write_text(SLOW_RM_REWARD)
    argv = _args(tiny_model_dir, synth_data_dir, tmp_path, 3, "actor_rollout_ref.hybrid_engine=False",
                 "reward.reward_model.enable=True", f"reward.reward_model.model_path={tmp_path / 'rm'}",
                 "reward.reward_model.enable_resource_pool=True", "reward.reward_model.n_gpus_per_node=0",
                 f"custom_reward_function.path={reward}")
    codes, log = _wait(_job(argv))
    assert codes == [0, 0], log[-4000:]
    rows = _steps(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["timing_s/reward_fn"] >= 0.8 and r["timing_s/reward_model"] > 0
        assert r["timing_s/reward"] >= r["timing_s/reward_fn"] + r["timing_s/reward_model"]
    assert rows[0]["timing_s/reward_overlap"] >= 0.8 * rows[1]["timing_s/gen"] > 0
