"""The built-in loops: `single_turn_agent` (one sampled turn) and `tool_agent` (verl's ToolAgentLoop: sample, call the
tools the turn asks for, append their answers, sample again).

tool_agent, per trajectory:
- each assistant turn's tokens are appended exactly as sampled (mask 1, their log-probs);
- the turn's text is decoded only to find tool calls (multi_turn.format, hermes); none ends the trajectory;
- at most max_parallel_calls calls run, concurrently, each in the tool pool on an event loop of its own (a tool that
  blocks cannot stall the other trajectories) under multi_turn.tool_timeout_s, and all of a trajectory's tool time
  under multi_turn.trajectory_timeout_s;
- a call that does not parse, names an unknown tool, raises or times out gets an error message as its response
  (counted in `tool_calls/errors`): the model sees it, the run goes on;
- responses longer than max_tool_response_length characters are cut on tool_response_truncate_side, rendered with
  the template's tool role (chat.py) and appended with mask 0, log-prob 0;
- it stops at the response budget (as verl, a tool turn that would fill it is not appended, so the last token is
  always sampled), at max_assistant_turns or max_user_turns.
Step rewards returned by `execute` are summed per trajectory (`tool_rewards`) and added to the reward function's
score by the trainer; `calc_reward` is not called by this loop (as verl's).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from polyrl.agents.base import AgentLoopBase, AgentLoopOutput, register
from polyrl.agents.tool_parser import PARSERS, FunctionCall, ParseError


@register("single_turn_agent")
class SingleTurnAgentLoop(AgentLoopBase):
    async def run(self, messages, sampling_params, **kwargs: Any) -> AgentLoopOutput:
        out = await self.server_manager.generate(request_id=kwargs["request_id"], prompt_ids=kwargs["prompt_ids"],
                                                 sampling_params=sampling_params, max_new_tokens=self.response_length)
        return AgentLoopOutput(prompt_ids=list(kwargs["prompt_ids"]), response_ids=out.token_ids,
                               response_mask=[1] * len(out.token_ids), response_logprobs=out.log_probs, num_turns=2,
                               weight_versions=[out.weight_version])


def truncate_text(text: str, limit: int, side: str) -> str:
    if len(text) <= limit:
        return text
    if side == "left":  # cut the left side: keep the end
        return "(truncated)..." + text[-limit:]
    if side == "right":
        return text[:limit] + "...(truncated)"
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[len(text) - (limit - half):]


@register("tool_agent")
class ToolAgentLoop(AgentLoopBase):
    async def run(self, messages, sampling_params, **kwargs: Any) -> AgentLoopOutput:
        cfg = self.config
        rid, prompt_ids = kwargs["request_id"], list(kwargs["prompt_ids"])
        tools_kwargs = kwargs.get("tools_kwargs") or {}
        parse = PARSERS[cfg.format]
        resp, mask, lps, versions, rewards = [], [], [], [], []
        chat = list(messages) if kwargs.get("keep_messages") else None
        m = {"tool_calls": 0, "tool_errors": 0, "tool_s": 0.0}
        assistant_turns = user_turns = 0
        tool_budget = cfg.trajectory_timeout_s
        while len(resp) < self.response_length:
            out = await self.server_manager.generate(request_id=rid, prompt_ids=prompt_ids + resp,
                                                     sampling_params=sampling_params,
                                                     max_new_tokens=self.response_length - len(resp))
            resp += out.token_ids
            mask += [1] * len(out.token_ids)
            lps += out.log_probs
            versions.append(out.weight_version)
            assistant_turns += 1
            # parsed with special tokens kept: a tokenizer may make <tool_call> one (the tiny quickstart's does)
            text = self.tokenizer.decode(out.token_ids, skip_special_tokens=False)
            if chat is not None:
                chat.append({"role": "assistant", "content": self.tokenizer.decode(out.token_ids,
                                                                                   skip_special_tokens=True)})
            if len(resp) >= self.response_length or (cfg.max_assistant_turns and
                                                     assistant_turns >= cfg.max_assistant_turns) \
                    or (cfg.max_user_turns and user_turns >= cfg.max_user_turns):
                break
            calls = parse(text)[: cfg.max_parallel_calls]
            if not calls or tool_budget <= 0:
                break
            t0 = time.perf_counter()
            results = await asyncio.gather(*(self._call(c, tools_kwargs, min(cfg.tool_timeout_s, tool_budget))
                                             for c in calls))
            spent = time.perf_counter() - t0
            tool_budget -= spent
            m["tool_s"] += spent
            m["tool_calls"] += len(calls)
            m["tool_errors"] += sum(err for _, _, err in results)
            rewards += [r for _, r, _ in results]
            tool_msgs = [{"role": "tool", "content": truncate_text(t, cfg.max_tool_response_length,
                                                                   cfg.tool_response_truncate_side)}
                         for t, _, _ in results]
            ids = self.renderer.tool_turn_ids(tool_msgs, ended_turn=out.finish_reason == "stop")
            if len(resp) + len(ids) >= self.response_length:
                break
            if chat is not None:
                chat += tool_msgs
            resp += ids
            mask += [0] * len(ids)
            lps += [0.0] * len(ids)
            user_turns += 1
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=resp, response_mask=mask, response_logprobs=lps,
                               num_turns=assistant_turns + user_turns + 1, tool_rewards=rewards, metrics=m,
                               weight_versions=versions, messages=chat)

    async def _call(self, call: FunctionCall | ParseError, tools_kwargs: dict, timeout: float
                    ) -> tuple[str, float, bool]:
        """(response text, step reward, whether it failed) for one call; never raises."""
        if isinstance(call, ParseError):
            return call.message, 0.0, True
        tool = self.tools.get(call.name)
        if tool is None:
            return f"Error: there is no tool named '{call.name}'; the tools are {sorted(self.tools)}.", 0.0, True
        create_kwargs = (tools_kwargs.get(call.name) or {}).get("create_kwargs") or {}

        async def once():
            # verl's tools take create_kwargs either whole (newer) or spread as keywords (older); both are given
            created = await tool.create(create_kwargs=create_kwargs, **create_kwargs)
            iid = created[0] if isinstance(created, tuple) else created  # (id, ToolResponse) or a bare id
            try:
                return await tool.execute(iid, call.arguments)
            finally:
                await tool.release(iid)

        loop = asyncio.get_running_loop()
        try:  # its own event loop in a pool thread: a tool that blocks stalls only itself
            resp, reward, metrics = await asyncio.wait_for(loop.run_in_executor(self.tool_pool, asyncio.run, once()),
                                                           timeout)
        except asyncio.TimeoutError:
            return f"Error: the tool '{call.name}' took longer than {timeout:.0f} s and was abandoned.", 0.0, True
        except Exception as e:
            return f"Error: the tool '{call.name}' failed: {type(e).__name__}: {e}", 0.0, True
        text = _response_text(resp)
        failed = bool((metrics or {}).get("error")) if isinstance(metrics, dict) else False
        return text, float(reward or 0.0), failed


def _response_text(resp) -> str:
    """A tool's response as text: a ToolResponse, a verl-style {"text": ...} dict, or a plain string."""
    if isinstance(resp, str):
        return resp
    if isinstance(resp, dict):
        return str(resp.get("text") or "")
    return str(getattr(resp, "text", None) or "")
