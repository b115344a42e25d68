"""The overhead of the OpenAI-compatible endpoint (polyrl/agents/openai_server.py): the same multi-turn sessions
sampled through HTTP (`openai_agent`, a urllib client per session in its own thread) and straight through the
server_manager (a loop calling `server_manager.generate` with the same token ids), on one engine, greedy.

    python benchmarks/openai_endpoint.py                                  # CPU, tiny random model
    python benchmarks/openai_endpoint.py --device cuda --sessions 64      # one GPU

Printed: the device, ms per request for both paths (mean over every turn of every session, client-side latency),
their difference (the endpoint's overhead per request: HTTP, JSON, chat-template rendering of the new messages,
decoding and tool-call parsing), the endpoint's own server-side time per request, the engine calls and the rollout's
wall time both ways. Both paths must produce the same trajectories (asserted), so the comparison is of equal work.
The anchor: the engine's own time per request (the direct path's latency); the overhead is measured against it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from polyrl.agents.base import AgentLoopBase, AgentLoopOutput, register  # noqa: E402
from polyrl.agents.config import AgentConfig, MultiTurnConfig  # noqa: E402
from polyrl.agents.openai_server import _ENDPOINTS, OpenAIAgentLoop  # noqa: E402
from polyrl.agents.runner import AgentRunner  # noqa: E402
from polyrl.data.dataset import RLSample  # noqa: E402
from polyrl.rollout.base import SamplingParams  # noqa: E402
from polyrl.rollout.config import RolloutConfig  # noqa: E402
from polyrl.rollout.native import NativeEngine  # noqa: E402

TURNS, TOKENS = 4, 8
LATENCY: dict[str, list[float]] = {"http": [], "direct": []}
FOLLOW_UP = {"role": "user", "content": "Go on."}
ENDPOINT: list = []  # the last rollout's endpoint, for its server-side stats


@register("bench_openai_http")
class HttpClient(OpenAIAgentLoop):
    async def client(self, base_url, sample):
        msgs = list(sample.raw_prompt)
        for _ in range(TURNS):
            req = urllib.request.Request(base_url + "/chat/completions", headers={"Content-Type": "application/json"},
                                         data=json.dumps({"messages": msgs, "max_tokens": TOKENS}).encode())
            t0 = time.perf_counter()
            with urllib.request.urlopen(req, timeout=600) as r:
                answer = json.loads(r.read())
            LATENCY["http"].append(time.perf_counter() - t0)
            msgs += [answer["choices"][0]["message"], FOLLOW_UP]
        ENDPOINT[:] = [_ENDPOINTS[self.server_manager][0]]
        return None


@register("bench_openai_direct")
class DirectLoop(AgentLoopBase):
    """The same conversation without HTTP: token ids straight to the server_manager."""

    async def run(self, messages, sampling_params, **kw) -> AgentLoopOutput:
        prompt, resp, mask, lps = self.renderer.prompt_ids(messages), [], [], []
        ended = True
        for turn in range(TURNS):
            if turn:
                ids = self.renderer.tool_turn_ids([FOLLOW_UP], ended_turn=ended)
                resp, mask, lps = resp + ids, mask + [0] * len(ids), lps + [0.0] * len(ids)
            t0 = time.perf_counter()
            out = await self.server_manager.generate(request_id=kw["request_id"], prompt_ids=prompt + resp,
                                                     sampling_params={}, max_new_tokens=TOKENS)
            LATENCY["direct"].append(time.perf_counter() - t0)
            resp, mask, lps = resp + out.token_ids, mask + [1] * len(out.token_ids), lps + out.log_probs
            ended = out.finish_reason == "stop"
        return AgentLoopOutput(prompt_ids=prompt, response_ids=resp, response_mask=mask, response_logprobs=lps,
                               num_turns=2 * TURNS)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from transformers import LlamaForCausalLM

    from agent_templates import QWEN25_TEMPLATE
    from polyrl.models.tiny import build_char_tokenizer, tiny_config

    if args.device == "cpu":
        torch.set_num_threads(1)
    tok = build_char_tokenizer(QWEN25_TEMPLATE)
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(len(tok), max_position_embeddings=2048)).eval().to(args.device)
    eng = NativeEngine.from_hf(model, device=args.device, dtype=torch.float32, max_num_seqs=max(8, args.sessions),
                               max_num_batched_tokens=2048, num_kv_tokens=args.sessions * 1024)
    samples = [RLSample(prompt_ids=[], raw_prompt=[{"role": "user", "content": f"Question {i}: what is {i}*7?"}],
                        data_source="x", ground_truth="", extra_info={}, index=i) for i in range(args.sessions)]
    sp = SamplingParams(n=1, temperature=0.0, max_new_tokens=TURNS * 64, stop_token_ids=(tok.eos_token_id,))
    walls, outs, server_ms = {"http": [], "direct": []}, {}, []
    for rep in range(args.repeats + 1):  # the first round warms up
        for mode in ("direct", "http"):
            LATENCY[mode].clear()
            r = RolloutConfig(multi_turn=MultiTurnConfig(enable=True),
                              agent=AgentConfig(default_agent_loop=f"bench_openai_{mode}"))
            runner = AgentRunner(r, tok, response_length=TURNS * 64)
            t0 = time.perf_counter()
            outs[mode] = runner.generate(eng, samples, sp)
            if rep:
                walls[mode].append((time.perf_counter() - t0, statistics.mean(LATENCY[mode])))
            if rep and mode == "http":
                st = ENDPOINT[0].stats
                server_ms.append(1e3 * (st["handler_s"] - st["engine_wait_s"]) / st["num_requests"])
    assert outs["http"].token_ids == outs["direct"].token_ids, "the two paths sampled different trajectories"
    assert outs["http"].response_masks == outs["direct"].response_masks
    calls = {m: int(outs[m].metrics["rollout/num_generate_calls"]) for m in outs}
    ms = {m: 1e3 * statistics.median(lat for _, lat in walls[m]) for m in walls}
    wall = {m: statistics.median(w for w, _ in walls[m]) for m in walls}
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"cpu ({torch.get_num_threads()} "\
        "thread)"
    print(f"device: {device}; {args.sessions} concurrent sessions x {TURNS} turns x {TOKENS} tokens, tiny Llama "
          f"(2 layers, d=64), greedy; median of {args.repeats} rounds")
    print(f"direct server_manager: {ms['direct']:.1f} ms/request (the anchor: engine + batching), "
          f"rollout {wall['direct'] * 1e3:.0f} ms, {calls['direct']} engine calls")
    print(f"HTTP endpoint:         {ms['http']:.1f} ms/request, rollout {wall['http'] * 1e3:.0f} ms, "
          f"{calls['http']} engine calls")
    print(f"overhead: {ms['http'] - ms['direct']:+.1f} ms/request ({ms['http'] / ms['direct']:.2f}x); "
          f"trajectories identical on both paths")
    print(f"of which the endpoint's own work (parse, render, decode, JSON; outside the engine): "
          f"{statistics.median(server_ms):.2f} ms/request; the rest is the client's HTTP round trip")
    print(json.dumps({"bench": "openai_endpoint", "device": device, "sessions": args.sessions, "turns": TURNS,
                      "ms_per_request_direct": round(ms["direct"], 2), "ms_per_request_http": round(ms["http"], 2),
                      "overhead_ms_per_request": round(ms["http"] - ms["direct"], 2),
                      "endpoint_ms_per_request": round(statistics.median(server_ms), 3),
                      "engine_calls_direct": calls["direct"], "engine_calls_http": calls["http"],
                      "rollout_s_direct": round(wall["direct"], 3), "rollout_s_http": round(wall["http"], 3)}))


if __name__ == "__main__":
    main()
