"""The OpenAI-compatible endpoint (polyrl/agents/openai_server.py) on the native engine with a tiny random model:
a client using plain urllib drives two sessions of two turns each (a tool message between them); the trajectory the
trainer gets holds exactly the sampled ids and the engine's log-probs (checked against a fresh engine on the whole
conversation), the tool turn's template tokens with mask 0, and the client saw the decoded text; malformed requests
get 400s with OpenAI-shaped JSON errors."""

import http.client
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import pytest
import torch

from polyrl.agents.base import register
from polyrl.agents.chat import ToolTurnRenderer
from polyrl.agents.config import AgentConfig, MultiTurnConfig
from polyrl.agents.openai_server import OpenAIAgentLoop, tool_calls_of
from polyrl.agents.runner import AgentRunner
from polyrl.data.dataset import RLSample
from polyrl.rollout.base import SamplingParams
from polyrl.rollout.config import RolloutConfig
from polyrl.rollout.native import NativeEngine

sys.path.insert(0, str(Path(__file__).parent))
from agent_templates import QWEN25_TEMPLATE  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]


def post(url, body, headers=None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def keep_alive(conn, path, body, headers=None):
    conn.request("POST", path, body if isinstance(body, bytes) else json.dumps(body),
                 {"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    return r.status, json.loads(r.read())


SEEN: dict = {}  # what each session's client saw, by base url


@register("test_openai_two_turns")
class TwoTurnClient(OpenAIAgentLoop):
    async def client(self, base_url, sample):
        url = base_url + "/chat/completions"
        msgs = list(sample.raw_prompt)
        st, r1 = post(url, {"model": "m", "messages": msgs, "tools": TOOLS, "max_tokens": 6})
        assert st == 200, r1
        msgs += [r1["choices"][0]["message"], {"role": "tool", "tool_call_id": "call_0", "content": "42"}]
        st, r2 = post(url, {"messages": msgs, "tools": TOOLS, "max_tokens": 5, "temperature": 0.0})
        assert st == 200, r2
        # the bad requests share one kept-alive connection (as the OpenAI client's): each answer leaves it usable
        conn = http.client.HTTPConnection(urlparse(url).netloc, timeout=60)
        path = urlparse(url).path
        errors = [keep_alive(conn, path, b"{not json"),  # malformed JSON
                  keep_alive(conn, path, {"messages": "hi"}),  # messages not a list
                  keep_alive(conn, path, {"messages": msgs[:1] + [{"role": "user", "content": "edited"}]}),  # edited
                  keep_alive(conn, path, {"messages": msgs, "temperature": 0.7}),  # not the rollout's sampling
                  keep_alive(conn, "/v1/chat/completions", {"messages": msgs}),  # no session
                  # the session named by the header instead of the URL: reaches it (the messages error, not "unknown")
                  keep_alive(conn, "/v1/chat/completions", {"messages": []},
                             {"X-Session-Id": base_url.split("/s/")[1].split("/")[0]}),
                  ]
        conn.close()
        SEEN[base_url] = (r1, r2, errors)
        return 1.0


def _setup():
    from transformers import LlamaForCausalLM

    from polyrl.models.tiny import build_char_tokenizer, tiny_config

    tok = build_char_tokenizer(QWEN25_TEMPLATE)
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(len(tok), max_position_embeddings=2048)).eval()
    mk = lambda: NativeEngine.from_hf(model, dtype=torch.float32, max_num_seqs=8, max_num_batched_tokens=256,  # noqa
                                      num_kv_tokens=4096)
    return tok, mk


def test_two_sessions_record_exactly_what_was_sampled_and_bad_requests_get_400():
    tok, mk = _setup()
    eng, ref = mk(), mk()
    r = RolloutConfig(multi_turn=MultiTurnConfig(enable=True),
                      agent=AgentConfig(default_agent_loop="test_openai_two_turns"))
    runner = AgentRunner(r, tok, response_length=128, keep_messages=True)
    sample = RLSample(prompt_ids=[], raw_prompt=[{"role": "user", "content": "What is 6*7?"}], data_source="x",
                      ground_truth="42", extra_info={}, index=0)
    sp = SamplingParams(n=2, temperature=0.0, max_new_tokens=128, stop_token_ids=(tok.eos_token_id,))
    SEEN.clear()
    out = runner.generate(eng, [sample], sp)

    assert len(out.token_ids) == 2 and out.reward_scores == [1.0, 1.0] and len(SEEN) == 2
    renderer = ToolTurnRenderer(tok, tools=TOOLS)
    prompt = renderer.prompt_ids(sample.raw_prompt)
    greedy = lambda p, k: ref.generate([p], SamplingParams(n=1, temperature=0.0, max_new_tokens=k,  # noqa: E731
                                                           stop_token_ids=(tok.eos_token_id,)))
    want1 = greedy(prompt, 6)
    t1, lp1 = want1.token_ids[0], want1.logprobs[0]
    tool_ids = renderer.tool_turn_ids([{"role": "tool", "content": "42"}],
                                      ended_turn=want1.finish_reason[0] == "stop")
    want2 = greedy(prompt + t1 + tool_ids, 5)
    t2, lp2 = want2.token_ids[0], want2.logprobs[0]
    for row in range(2):  # both sessions (a GRPO group of 2), their turns interleaved in the engine's calls
        assert out.prompt_ids[row] == prompt
        assert out.token_ids[row] == t1 + tool_ids + t2  # the prefix invariant: sampled ids, tool turn, sampled ids
        assert out.response_masks[row] == [1] * len(t1) + [0] * len(tool_ids) + [1] * len(t2)
        assert torch.allclose(torch.tensor(out.logprobs[row]), torch.tensor(lp1 + [0.0] * len(tool_ids) + lp2),
                              atol=1e-4)
        assert out.num_turns[row] == 4 and len(out.weight_versions[row]) == 2
        assert [m["role"] for m in out.messages[row]] == ["user", "assistant", "tool", "assistant"]
    # the second turns continued on the sessions' kept KV: only the tool turn (and the last sampled token) prefilled
    assert out.metrics["rollout/prefill_tokens_saved"] >= 2 * (len(prompt) + len(t1) - 1)
    for r1, r2, errors in SEEN.values():
        # the client saw the sampled tokens as text, and the usage counts the trajectory's tokens
        assert r1["choices"][0]["message"]["content"] == tok.decode(t1, skip_special_tokens=False).removesuffix(
            tok.eos_token)
        assert r2["usage"] == {"prompt_tokens": len(prompt) + len(t1) + len(tool_ids), "completion_tokens": len(t2),
                               "total_tokens": len(prompt) + len(t1) + len(tool_ids) + len(t2)}
        for status, body in errors:
            assert status == 400 and body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
        assert "not valid JSON" in errors[0][1]["error"]["message"]
        assert "temperature=0.7" in errors[3][1]["error"]["message"]
        assert "unknown session" in errors[4][1]["error"]["message"]
        assert "non-empty list" in errors[5][1]["error"]["message"]
    eng.release_kept([])
    assert eng.kept == [] and eng.blocks.all_free()  # the sessions' kept KV was let go when they ended


def test_hermes_tool_calls_become_openai_tool_calls():
    content, calls = tool_calls_of('Let me compute. <tool_call>{"name": "calculator", "arguments": '
                                   '{"expression": "6*7"}}</tool_call>')
    assert content == "Let me compute."
    assert calls == [{"id": "call_0", "type": "function",
                      "function": {"name": "calculator", "arguments": '{"expression": "6*7"}'}}]
    bad = 'x <tool_call>{"name": oops}</tool_call>'
    assert tool_calls_of(bad) == (bad, [])  # an unparsable call stays in the content, as the model wrote it
    assert tool_calls_of("plain answer") == ("plain answer", [])


@register("test_openai_hangs")
class HangingClient(OpenAIAgentLoop):
    async def client(self, base_url, sample):
        st, r = post(base_url + "/chat/completions", {"messages": sample.raw_prompt, "max_tokens": 3})
        assert st == 200, r
        time.sleep(5)  # a client that hangs (blocking, in its own thread) past the trajectory's timeout
        return 1.0


def test_a_client_past_its_timeout_ends_with_what_its_session_recorded():
    tok, mk = _setup()
    r = RolloutConfig(multi_turn=MultiTurnConfig(enable=True, trajectory_timeout_s=1.5),
                      agent=AgentConfig(default_agent_loop="test_openai_hangs"))
    runner = AgentRunner(r, tok, response_length=16)
    sample = RLSample(prompt_ids=[], raw_prompt=[{"role": "user", "content": "hi"}], data_source="x",
                      ground_truth="", extra_info={}, index=0)
    t0 = time.perf_counter()
    out = runner.generate(mk(), [sample], SamplingParams(n=1, temperature=0.0, max_new_tokens=16,
                                                         stop_token_ids=(tok.eos_token_id,)))
    assert time.perf_counter() - t0 < 4.5  # the rollout did not wait for the client
    assert len(out.token_ids[0]) == 3 and out.response_masks[0] == [1, 1, 1] and out.reward_scores == [None]
    assert out.metrics["agent/client_timeouts"] == 1
