"""multi_turn.enable=True in the one-step off-policy pipeline (polyrl/trainer/async_ppo.py) on CPU: 2 processes over
gloo, 1 trainer + 1 rollout. The rollout process runs the agent loops; what the trainer trains on is what the engine
sampled there (tool tokens with response_mask 0, the engine's log-probs), each row's turns tagged with the weights
that sampled them, its staleness counted from its oldest turn, and the multi-turn metrics logged.

Both processes import a `sitecustomize` from the test's folder that records, in files, every turn the rollout's
engine sampled (`EngineServer._generate`) and every batch the trainer assembled (`_assemble_batch`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polyrl.trainer.async_ppo import staleness_metrics
from test_agent_trainer_on_cpu import write_agent_files

SPY = '''
import json
import os

if os.environ.get("SPY_OUT"):
    import torch

    from polyrl.agents.server import EngineServer
    from polyrl.trainer.rollout_batch import RolloutBatchMixin

    out = os.environ["SPY_OUT"]
    generate, assemble = EngineServer._generate, RolloutBatchMixin._assemble_batch

    def _generate(self, batch):
        turns = generate(self, batch)
        with open(os.path.join(out, "sampled.jsonl"), "a") as f:
            for t in turns:
                if t is not None:
                    f.write(json.dumps({"ids": t.token_ids, "lps": t.log_probs, "v": t.weight_version}) + "\\n")
        return turns

    def _assemble_batch(self, parts, want, metrics, device=None):
        res = assemble(self, parts, want, metrics, device)
        if self.ROLE == "train":
            batch = res[1]
            torch.save({"responses": batch["responses"], "response_mask": batch["response_mask"],
                        "rollout_log_probs": batch["rollout_log_probs"],
                        "ids": [i for p in parts for i in p["out"].token_ids],
                        "masks": [m for p in parts for m in p["out"].response_masks],
                        "turn_versions": [v for p in parts for v in p["out"].weight_versions],
                        "versions": [v for p in parts for v in p["versions"]]},
                       os.path.join(out, f"trained_{self.global_step}.pt"))
        return res

    EngineServer._generate, RolloutBatchMixin._assemble_batch = _generate, _assemble_batch
'''


def _setup(tmp_path: Path, model_dir: Path, data_dir: Path, steps: int, *extra: str) -> list[str]:
    write_agent_files(tmp_path, tmp_path / "spy", data_dir, 16)
    (tmp_path / "spy" / "sitecustomize.py").write_text(SPY)
    (tmp_path / "out").mkdir()
    return [
        "algorithm.adv_estimator=grpo", f"data.train_files={tmp_path / 'train.parquet'}",
        "data.train_batch_size=2", "data.max_prompt_length=32", "data.max_response_length=40",
        f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.ignore_eos=True", "trainer.device=cpu",
        "actor_rollout_ref.rollout.multi_turn.enable=True",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={tmp_path / 'loops.yaml'}",
        "actor_rollout_ref.hybrid_engine=False",
        f"trainer.run_dir={tmp_path / 'run'}", f"trainer.default_local_dir={tmp_path / 'ckpt'}",
        f"trainer.total_training_steps={steps}", "trainer.progress_bar=False", "trainer.logger=[file]",
        "trainer.save_freq=-1", *extra,
    ]


def _run(tmp_path: Path, argv: list[str], world: int = 2) -> list[dict]:
    """`polyrl train argv` as the `world` processes of one gloo job (rank 0 trains, the others generate); its step
    rows."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "SPY_OUT": str(tmp_path / "out"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "spy"), str(Path.cwd())]), "WORLD_SIZE": str(world),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    procs = [subprocess.Popen([sys.executable, "-m", "polyrl.train", *argv], env={**env, "RANK": r, "LOCAL_RANK": r},
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in map(str, reversed(range(world)))]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * world, "\n".join(logs)[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "actor/pg_loss" in r]


def _segments(ids: list[int], mask: list[int]) -> list[tuple[int, tuple[int, ...]]]:
    """Runs of equal mask: (mask value, the ids)."""
    out = []
    for i, m in zip(ids, mask):
        if out and out[-1][0] == m:
            out[-1][1].append(i)
        else:
            out.append((m, [i]))
    return [(m, tuple(s)) for m, s in out]


def _trained_as_sampled(tmp_path: Path, steps: int) -> list[dict]:
    """Each step's trained batch, checked against the rollout's sampled turns: every row's sampled runs (mask 1) are
    turns the engine sampled, with their log-probs; tool runs (mask 0) sit between them; the batch holds exactly those
    ids."""
    sampled = {}
    for line in (tmp_path / "out" / "sampled.jsonl").read_text().splitlines():
        t = json.loads(line)
        sampled[tuple(t["ids"])] = t
    batches = [torch.load(tmp_path / "out" / f"trained_{k}.pt") for k in range(steps)]
    for b in batches:
        for row, (ids, mask) in enumerate(zip(b["ids"], b["masks"])):
            n = len(ids)
            assert b["responses"][row, :n].tolist() == ids and b["response_mask"][row, :n].tolist() == mask
            assert b["response_mask"][row, n:].sum() == 0
            runs = _segments(ids, mask)
            assert [m for m, _ in runs] == [1, 0, 1], runs  # turn, tool, turn
            pos = 0
            for m, seg in runs:
                if m:
                    turn = sampled[seg]  # a KeyError: the trainer got ids the engine never sampled
                    got = b["rollout_log_probs"][row, pos:pos + len(seg)]
                    assert torch.allclose(got, torch.tensor(turn["lps"]), atol=1e-6)
                pos += len(seg)
            assert len(b["turn_versions"][row]) == 2 and b["versions"][row] == min(b["turn_versions"][row])
    return batches


def test_off_policy_multi_turn_trains_on_the_sampled_ids_with_tool_tokens_masked(tiny_model_dir, synth_data_dir,
                                                                                  tmp_path):
    steps = 3
    rows = _run(tmp_path, _setup(tmp_path, tiny_model_dir, synth_data_dir, steps))
    assert [r["step"] for r in rows] == [1, 2, 3]
    batches = _trained_as_sampled(tmp_path, steps)
    # one step off: batches 0 and 1 from the initial weights, batch 2 from step 1's; every turn of a row alike
    assert [sorted({v for t in b["turn_versions"] for v in t}) for b in batches] == [[0], [0], [1]]
    assert [r["async/staleness/max"] for r in rows] == [0.0, 1.0, 1.0]
    assert [r["async/weight_version/min"] for r in rows] == [0.0, 0.0, 1.0]
    assert all(r["async/weight_version/turn_span/max"] == 0.0 for r in rows)
    for r in rows:
        assert r["num_turns/mean"] == 4 and r["tool_calls/total"] == 4 and r["tool_calls/errors"] == 0
        assert r["reward_extra/tool_reward/mean"] == 0.5 and "timing_s/tool_calls" in r
        assert r["rollout/prefill_tokens_saved"] > 0  # the native engine kept each trajectory's cache between turns


def test_staleness_counts_a_multi_turn_sample_from_its_oldest_turn():
    m = staleness_metrics([1, 2], trained_version=3, max_age=2, turn_versions=[[1, 2, 3], [2, 2]])
    assert m["async/staleness/max"] == 2.0 and m["async/weight_version/turn_span/max"] == 2.0
    assert m["async/weight_version/turn_span/mean"] == 1.0
    assert "async/weight_version/turn_span/max" not in staleness_metrics([1], 1, 1)


def test_partial_rollouts_continue_trajectories_across_weight_versions(tiny_model_dir, synth_data_dir, tmp_path):
    """A cap of 2 tokens per call: each trajectory (3 sampled, the tool's, 3 sampled) spans 3 calls, a turn stopped at
    the cap continues on its kept cache in the next one, and a trajectory in flight when new weights arrive has turns
    of two versions; it is trained exactly as sampled and ages from its oldest turn."""
    steps = 3  # age 0: new weights before every batch, so batch 2 holds trajectories begun under version 0
    rows = _run(tmp_path, _setup(tmp_path, tiny_model_dir, synth_data_dir, steps, "async_training.partial_rollout=True",
                                 "async_training.partial_rollout_max_new_tokens=2",
                                 "async_training.max_trajectory_age_steps=0"))
    assert [r["step"] for r in rows] == [1, 2, 3]
    batches = _trained_as_sampled(tmp_path, steps)
    assert rows[0]["async/partial_rollout/gen_calls"] == 3  # the first trajectories' 6 tokens, 2 a call
    assert all(r["async/partial_rollout/turns_continued"] > 0 for r in rows)
    mixed = [k for k, b in enumerate(batches) if any(len(set(t)) == 2 for t in b["turn_versions"])]
    assert mixed, [b["turn_versions"] for b in batches]  # a trajectory whose turns two weight versions sampled
    for k, (b, r) in enumerate(zip(batches, rows)):
        spans = [max(t) - min(t) for t in b["turn_versions"]]
        assert r["async/weight_version/turn_span/max"] == max(spans)
        assert r["async/staleness/max"] == k - min(b["versions"])  # step k+1 trains with version k
        assert r["async/partial_rollout/version_span_max"] >= max(spans)
        assert r["num_turns/mean"] == 4 and r["tool_calls/total"] == 4 and "rollout/prefill_tokens_saved" in r
    assert all(rows[k]["async/weight_version/turn_span/max"] >= 1 for k in mixed)


def test_partial_multi_turn_rollouts_run_on_a_tensor_parallel_replica(tp_model_dir, synth_data_dir, tmp_path):
    """1 trainer + one rollout replica over 2 processes (TP 2): the replica's rank 0 runs the agent loops and decides
    each generation call, its other rank makes the same calls (ReplicaRollout.lead/follow), and the kept caches that
    carry turns across calls and weight versions are found on both ranks. Trained exactly as sampled, as above."""
    steps = 3
    rows = _run(tmp_path, _setup(tmp_path, tp_model_dir, synth_data_dir, steps, "async_training.partial_rollout=True",
                                 "async_training.partial_rollout_max_new_tokens=2",
                                 "async_training.max_trajectory_age_steps=0", "rollout.n_gpus_per_node=2",
                                 "actor_rollout_ref.rollout.tensor_model_parallel_size=2"), world=3)
    assert [r["step"] for r in rows] == [1, 2, 3]
    batches = _trained_as_sampled(tmp_path, steps)
    assert rows[0]["async/partial_rollout/gen_calls"] == 3
    assert any(len(set(t)) == 2 for b in batches for t in b["turn_versions"])
    for r in rows:
        assert r["async/partial_rollout/turns_continued"] > 0 and r["rollout/prefill_tokens_saved"] > 0
        assert r["num_turns/mean"] == 4 and r["tool_calls/total"] == 4


def test_multi_turn_and_partial_rollouts_are_accepted_on_tensor_parallel_replicas():
    from polyrl.config import build_config
    from polyrl.trainer.async_config import check_async
    from polyrl.trainer.checks import check_multi_turn
    from polyrl.trainer.config import PPOConfig

    on = ["actor_rollout_ref.rollout.multi_turn.enable=True", "actor_rollout_ref.hybrid_engine=False"]
    for extra in ([], ["async_training.partial_rollout=True"]):
        cfg = build_config(PPOConfig(), on + extra + ["rollout.n_gpus_per_node=2",
                                                      "actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
        check_multi_turn(cfg)
        check_async(cfg)


def test_a_turn_stopped_at_the_budget_continues_in_the_next_call_and_keeps_its_first_version(tiny_model_dir):
    """Partial rollouts' agent pool on a scripted engine: a 5-token turn at 2 tokens a call spans 3 calls (weights
    versions 0, 1, 2), each call continuing the tokens so far, and ends as one turn tagged with version 0."""
    from polyrl.agents.config import AgentConfig, MultiTurnConfig
    from polyrl.agents.runner import AgentRunner
    from polyrl.data.dataset import RLSample
    from polyrl.models.loader import load_tokenizer
    from polyrl.rollout.base import Generation, SamplingParams
    from polyrl.rollout.config import RolloutConfig
    from polyrl.trainer.partial_rollout import AgentPartialRollouts, row_metrics

    class Positions:  # samples each row's next positions: a continued row gets what one long call would give
        calls: list = []

        def generate(self, prompts, sp):
            rows = [p for p in prompts for _ in range(sp.n)]
            self.calls.append([(len(p), m) for p, m in zip(rows, sp.max_new_tokens_per_row)])
            toks = [list(range(len(p), len(p) + m)) for p, m in zip(rows, sp.max_new_tokens_per_row)]
            return Generation(prompt_index=[i // sp.n for i in range(len(rows))], token_ids=toks,
                              logprobs=[[-0.5] * len(t) for t in toks], finish_reason=["length"] * len(rows))

    rollout = RolloutConfig(multi_turn=MultiTurnConfig(enable=True),
                            agent=AgentConfig(default_agent_loop="single_turn_agent"))
    runner = AgentRunner(rollout, load_tokenizer(str(tiny_model_dir)), response_length=5)
    engine = Positions()
    pool = AgentPartialRollouts(runner.start(engine, SamplingParams(n=2, max_new_tokens=5), budget=2))
    pool.add([RLSample(prompt_ids=[7, 8, 9], raw_prompt=[], data_source="x", ground_truth="")], {"draw": 0})
    continued = [pool.run(version) for version in (0, 1, 2)]
    assert engine.calls == [[(3, 2)] * 2, [(5, 2)] * 2, [(7, 1)] * 2]  # the prompt, then the tokens so far
    assert continued == [0, 2, 2] and pool.num_done() == 1
    groups = pool.take(1)
    _, out = pool.part(groups)
    assert out.token_ids == [[3, 4, 5, 6, 7]] * 2 and out.weight_versions == [[0], [0]]
    assert out.finish_reason == ["length"] * 2 and out.metrics["rollout/num_generate_calls"] == 3
    assert row_metrics(groups)["async/partial_rollout/version_span_max"] == 0  # one turn: its first token's version
    assert [(r.start, r.end) for r in groups[0].rows] == [(0, 2)] * 2
    pool.close()


def test_rows_that_keep_their_cache_give_it_up_when_a_waiting_prompt_needs_the_blocks():
    """keep_cache with more rows in one call than the KV cache holds at once (partial rollouts bring a new batch
    beside the trajectories in flight): finished rows let their kept blocks go for the waiting ones instead of the
    engine stalling; the tokens are a plain call's, and the rows that kept a cache still hold it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from polyrl.rollout.base import SamplingParams
    from polyrl.rollout.native import NativeEngine

    torch.manual_seed(0)
    m = Qwen2ForCausalLM(Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (30,), generator=g).tolist() for _ in range(4)]  # 38 tokens: 3 blocks each

    def engine():
        return NativeEngine.from_hf(m, dtype=torch.float32, max_num_seqs=2, max_num_batched_tokens=64,
                                    num_kv_tokens=160, block_size=16)  # 10 blocks: 3 rows' worth

    eng = engine()
    out = eng.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=8, keep_cache=True))
    want = engine().generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=8))
    assert out.token_ids == want.token_ids
    kept = [h for h in out.handles if h is not None]
    assert 0 < len(kept) < 4 and len(eng.kept) == len(kept)
    eng.release_kept(out.handles)
    assert eng.blocks.all_free()
