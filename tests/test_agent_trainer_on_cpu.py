"""multi_turn.enable=True through `polyrl train` on a tiny model: a loop registered by
`agent.agent_loop_config_path` (and picked by the data column `agent_name`) puts a tool turn between two sampled
turns; the trainer's batch masks the tool tokens (response_mask 0), adds the tool's step reward to the score, and
logs the multi-turn metrics; the native and hf engines both run it. Bad input ends the run before the model loads."""

import json

import pytest

from polyrl.cli import main as cli_main
from polyrl.data.dataset import read_parquet_rows, write_parquet

pytestmark = pytest.mark.usefixtures("one_thread")

LOOP = '''
from polyrl.agents import AgentLoopOutput
from polyrl.agents.loops import ToolAgentLoop

class OneToolTurn(ToolAgentLoop):
    """Samples a turn, then always 'calls' the calculator with 6*7, then samples the last turn."""
    async def run(self, messages, sampling_params, **kw):
        rid, prompt = kw["request_id"], list(kw["prompt_ids"])
        a = await self.server_manager.generate(request_id=rid, prompt_ids=prompt, max_new_tokens=3)
        text, reward, _ = await self._call(_Call(), kw.get("tools_kwargs") or {}, 5.0)
        tool = self.renderer.tool_turn_ids([{"role": "tool", "content": text}], a.finish_reason == "stop")
        b = await self.server_manager.generate(request_id=rid, prompt_ids=prompt + a.token_ids + tool,
                                               max_new_tokens=3)
        ids = a.token_ids + tool + b.token_ids
        return AgentLoopOutput(prompt_ids=prompt, response_ids=ids,
                               response_mask=[1] * len(a.token_ids) + [0] * len(tool) + [1] * len(b.token_ids),
                               response_logprobs=a.log_probs + [0.0] * len(tool) + b.log_probs, num_turns=4,
                               tool_rewards=[reward], metrics={"tool_calls": 1, "tool_errors": 0, "tool_s": 0.0},
                               weight_versions=[a.weight_version, b.weight_version])

class _Call:
    name, arguments = "reward_calc", {"expression": "6*7"}
'''
TOOL = '''
from polyrl.tools.calculator import CalculatorTool

class RewardCalc(CalculatorTool):
    async def execute(self, instance_id, parameters, **kw):
        resp, _, m = await super().execute(instance_id, parameters)
        return resp, 0.5, m  # a step reward, to see it reach the score
'''


def write_agent_files(tmp_path, code_dir, data_dir, num_rows: int) -> None:
    """The loop and tool modules (importable from `code_dir`), loops.yaml, tools.yaml and a train.parquet of
    `num_rows` rows that name the loop, in `tmp_path` (also used by test_agent_offpolicy_on_cpu.py)."""
    code_dir.mkdir(exist_ok=True)
    (code_dir / "my_loops.py").write_text(LOOP)
    (code_dir / "my_tools.py").write_text(TOOL)
    (tmp_path / "loops.yaml").write_text("- name: one_tool_turn\n  _target_: my_loops.OneToolTurn\n")
    (tmp_path / "tools.yaml").write_text(
        "tools:\n  - class_name: my_tools.RewardCalc\n    config: {type: native}\n    tool_schema: {type: function, "
        "function: {name: reward_calc, parameters: {type: object, properties: {expression: {type: string}}}}}\n")
    rows = read_parquet_rows(str(data_dir / "train.parquet"))[:num_rows]
    for r in rows:
        r["agent_name"] = "one_tool_turn"
    write_parquet(rows, tmp_path / "train.parquet")


def _setup(tmp_path, tiny_model_dir, synth_data_dir, monkeypatch):
    write_agent_files(tmp_path, tmp_path, synth_data_dir, 8)
    monkeypatch.syspath_prepend(str(tmp_path))
    return [
        "train", "algorithm.adv_estimator=grpo", f"data.train_files={tmp_path / 'train.parquet'}",
        "data.train_batch_size=2", "data.max_prompt_length=32", "data.max_response_length=40",
        f"actor_rollout_ref.model.path={tiny_model_dir}", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.multi_turn.enable=True",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={tmp_path / 'loops.yaml'}",
        "trainer.logger=[file]", f"trainer.run_dir={tmp_path / 'run'}", f"trainer.default_local_dir={tmp_path / 'ck'}",
        "trainer.total_training_steps=1", "trainer.progress_bar=False", "trainer.save_freq=-1",
    ]


@pytest.mark.parametrize("engine", ["native", "hf"])
def test_tool_tokens_are_masked_and_step_rewards_reach_the_score(tiny_model_dir, synth_data_dir, tmp_path,
                                                                  monkeypatch, engine):
    from polyrl.trainer.rollout_batch import RolloutBatchMixin

    seen = {}
    assemble = RolloutBatchMixin._assemble_batch

    def spy(self, parts, want, metrics):
        out = assemble(self, parts, want, metrics)
        seen.update(batch=out[1], gen=parts[0]["out"], scores=parts[0]["scores"])
        return out

    monkeypatch.setattr(RolloutBatchMixin, "_assemble_batch", spy)
    args = _setup(tmp_path, tiny_model_dir, synth_data_dir, monkeypatch)
    assert cli_main(args + [f"actor_rollout_ref.rollout.name={engine}"]) == 0
    batch, gen = seen["batch"], seen["gen"]
    for i, mask in enumerate(gen.response_masks):
        assert 0 in mask and batch["response_mask"][i, : len(mask)].tolist() == mask
        assert batch["responses"][i, : len(mask)].tolist() == gen.token_ids[i]
    assert all(s >= 0.5 for s in seen["scores"])  # reward function (0 or 1) + the tool's 0.5
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["num_turns/mean"] == 4 and row["tool_calls/total"] == 4 and row["reward_extra/tool_reward/mean"] == 0.5
    if engine == "native":  # the second turn continued on the first one's cache
        assert row["rollout/prefill_tokens_saved"] > 0


def test_bad_agent_input_ends_the_run_with_one_sentence(tiny_model_dir, synth_data_dir, tmp_path, monkeypatch,
                                                        capsys):
    args = _setup(tmp_path, tiny_model_dir, synth_data_dir, monkeypatch)
    rows = read_parquet_rows(str(tmp_path / "train.parquet"))
    rows[3]["agent_name"] = "nobody_registered_this"
    write_parquet(rows, tmp_path / "bad.parquet")
    missing_class = tmp_path / "missing_class.yaml"
    missing_class.write_text((tmp_path / "tools.yaml").read_text().replace("my_tools.RewardCalc", "my_tools.Nope"))
    not_openai = tmp_path / "not_openai.yaml"
    not_openai.write_text((tmp_path / "tools.yaml").read_text().replace("{type: function, function:", "{function:"))
    tc = "actor_rollout_ref.rollout.multi_turn.tool_config_path="
    cases = [
        ([f"data.train_files={tmp_path / 'bad.parquet'}"], "agent_name='nobody_registered_this'"),
        ([tc + str(missing_class)], "class_name 'my_tools.Nope' cannot be imported"),
        ([tc + str(not_openai)], "it must be an OpenAI function"),
        (["actor_rollout_ref.rollout.multi_turn.tool_config_path=" + str(tmp_path / "missing.yaml")], "not a file"),
        (["actor_rollout_ref.rollout.multi_turn.enable=False"], "multi_turn.enable is False"),
    ]
    for extra, want in cases:
        assert cli_main(args + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert want in err[-1] and len(err[-1].split(". ")) <= 2, err[-1]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing was rolled out
