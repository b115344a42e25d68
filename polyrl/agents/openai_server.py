"""An OpenAI-compatible chat-completions endpoint on the engine, so agent code written against the OpenAI client can
be trained: `openai_agent` loops hand the user's code a base URL, serve its `POST .../v1/chat/completions` through the
rollout's `server_manager` (server.py: the turns of all sessions are batched together and keep their KV cache), and
record per session the exact token ids, response mask and log-probs the trainer consumes.

    class MyAgent(OpenAIAgentLoop):                     # registered by rollout.agent.agent_loop_config_path
        async def client(self, base_url, sample):       # e.g. openai.AsyncOpenAI(base_url=base_url, api_key="x")
            ...                                         # any number of chat.completions calls, tool calls included
            return reward                               # a float (the loop's reward_score) or None (the reward fn's)

Token in, token out: the endpoint never re-tokenizes what the model wrote. A session's first request is rendered with
the chat template (its `tools` shown); each later request must repeat the conversation so far and add user or tool
messages after the last assistant turn, and only those new messages are tokenized (chat.py's delta rendering) and
appended with mask 0. What the client sends back as the assistant's message is not read: the trajectory holds the
sampled tokens. hermes `<tool_call>` blocks become OpenAI `tool_calls`.

The HTTP server is asyncio's streams (no dependency), one per rollout on 127.0.0.1, with a session per trajectory
(its id in the URL, `/s/<id>/v1`, or in the `X-Session-Id` header or the request's `user`). The user's `client` runs
on an event loop of its own in a thread, so a blocking client (urllib, the sync OpenAI client) stalls only itself;
past `multi_turn.trajectory_timeout_s` the trajectory ends with what its session recorded (metric
`agent/client_timeouts`).
Sampling is the rollout's: a request's `temperature`/`top_p` must be absent or equal to it (the trainer's log-probs
assume them), else it gets a 400, as does any other malformed request, with an OpenAI-shaped JSON error.
"""

from __future__ import annotations

import asyncio
import json
import time
import weakref
import threading
from dataclasses import dataclass, field
from typing import Any

from polyrl.agents.base import AgentLoopBase, AgentLoopOutput, register
from polyrl.agents.chat import ToolTurnRenderer
from polyrl.agents.tool_parser import FunctionCall, parse_hermes

_HERMES_BLOCK = "<tool_call>"


class RequestError(Exception):
    """A malformed request: answered with this status and an OpenAI-shaped error."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class Session:
    """One trajectory as the trainer will see it, grown by each request."""

    response_length: int
    renderer: ToolTurnRenderer | None = None
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # the conversation so far, as the client must repeat it
    ended_turn: bool = True  # the last assistant turn ended on its end-of-turn token (else a length stop)
    num_assistant_turns: int = 0
    num_user_turns: int = 0
    full: bool = False  # the response budget is spent: later requests get an empty `length` answer
    last_answer: dict | None = None  # the assistant message of the last response
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def tool_calls_of(text: str) -> tuple[str, list[dict]]:
    """(content, OpenAI tool_calls) of an assistant text in hermes format. A call that does not parse stays in the
    content (the client's code sees what the model wrote)."""
    calls = parse_hermes(text)
    if not calls or not all(isinstance(c, FunctionCall) for c in calls):
        return text, []
    content = text[: text.find(_HERMES_BLOCK)].strip()
    return content, [{"id": f"call_{i}", "type": "function",
                      "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                     for i, c in enumerate(calls)]


class OpenAIEndpoint:
    """The HTTP server of one rollout over its `server_manager`; `open(sid)` before a session's requests,
    `close(sid)` returns what it recorded."""

    def __init__(self, server_manager, tokenizer, *, template_kwargs: dict | None = None, temperature: float | None
                 = None, top_p: float | None = None, model: str = "polyrl"):
        self.server_manager, self.tok, self.kw, self.model = server_manager, tokenizer, dict(template_kwargs or {}), \
            model
        self.temperature, self.top_p = temperature, top_p
        self.sessions: dict[str, Session] = {}
        self.stats = {"num_requests": 0, "num_errors": 0, "handler_s": 0.0, "engine_wait_s": 0.0}
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()  # open connections, closed by stop()
        self._renderers: dict[str, ToolTurnRenderer] = {}
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def session_url(self, sid: str) -> str:
        return f"http://127.0.0.1:{self.port}/s/{sid}/v1"

    async def start(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for w in list(self._writers):  # a kept-alive client connection would hold wait_closed (Python >= 3.12)
                w.close()
            await asyncio.wait_for(self._server.wait_closed(), 5.0)
            self._server = None

    def open(self, sid: str, response_length: int) -> None:
        self.sessions[sid] = Session(response_length)

    def close(self, sid: str) -> Session:
        return self.sessions.pop(sid)

    # HTTP/1.1, keep-alive, Content-Length bodies only (what the OpenAI clients and urllib send)
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = (lines[0].split(" ", 2) + ["", ""])[:3]
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                close = headers.get("connection", "").lower() == "close"
                if "chunked" in headers.get("transfer-encoding", "").lower():  # the body's end is unknown: close
                    status, payload, close = 411, _error("send the body with a Content-Length (not chunked).",
                                                         "invalid_request_error"), True
                else:
                    body = await reader.readexactly(int(headers.get("content-length") or 0))
                    status, payload = await self.handle(method, path, headers, body)
                data = json.dumps(payload).encode()
                writer.write(f"HTTP/1.1 {status} {'OK' if status == 200 else 'Error'}\r\nContent-Type: "
                             f"application/json\r\nContent-Length: {len(data)}\r\n"
                             f"Connection: {'close' if close else 'keep-alive'}\r\n\r\n".encode() + data)
                await writer.drain()
                if close:
                    return
        finally:
            self._writers.discard(writer)
            writer.close()

    async def handle(self, method: str, path: str, headers: dict, body: bytes) -> tuple[int, dict]:
        t0 = time.perf_counter()
        self.stats["num_requests"] += 1
        try:
            return 200, await self._route(method, path, headers, body)
        except RequestError as e:
            self.stats["num_errors"] += 1
            return e.status, _error(str(e), "invalid_request_error")
        except Exception as e:  # an engine failure: the client sees it as a 500, the trajectory fails with it
            self.stats["num_errors"] += 1
            return 500, _error(f"{type(e).__name__}: {e}", "server_error")
        finally:
            self.stats["handler_s"] += time.perf_counter() - t0

    async def _route(self, method, path, headers, body) -> dict:
        path = path.split("?", 1)[0].rstrip("/")
        sid = None
        if path.startswith("/s/"):
            sid, _, path = path[3:].partition("/")
            path = "/" + path
        if path == "/v1/models" and method == "GET":
            return {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "polyrl"}]}
        if path != "/v1/chat/completions":
            raise RequestError(f"no route {method} {path}; polyrl serves POST /v1/chat/completions.", 404)
        if method != "POST":
            raise RequestError(f"{method} {path} is not served; use POST.", 405)
        try:
            req = json.loads(body or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"the request body is not valid JSON ({e}).") from None
        if not isinstance(req, dict):
            raise RequestError("the request body must be a JSON object with `messages`.")
        sid = sid or headers.get("x-session-id") or req.get("user")
        if sid not in self.sessions:
            raise RequestError(f"unknown session {sid!r}; use the base URL the agent loop gave (/s/<session>/v1), "
                               "or name an open session in the X-Session-Id header or the `user` field.")
        return await self._complete(sid, self.sessions[sid], req)

    def _check(self, req: dict) -> tuple[list[dict], int | None]:
        msgs = req.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                             for m in msgs):
            raise RequestError("`messages` must be a non-empty list of {role, content} objects.")
        for key, want in (("temperature", self.temperature), ("top_p", self.top_p)):
            got = req.get(key)
            if got is not None and want is not None and abs(float(got) - want) > 1e-6:
                raise RequestError(f"{key}={got} differs from the rollout's {want}; sampling is the rollout's (the "
                                   f"trainer's log-probs assume it): omit {key} or send {want}.")
        if req.get("n") not in (None, 1) or req.get("stream"):
            raise RequestError("n > 1 and stream are not served; each trajectory is one session of single answers.")
        max_tokens = req.get("max_completion_tokens", req.get("max_tokens"))
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise RequestError(f"max_tokens={max_tokens!r} must be a positive integer.")
        tools = req.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise RequestError("`tools` must be a list of OpenAI tool objects ({type: function, function: {...}}).")
        return msgs, max_tokens

    def _renderer(self, tools: list[dict] | None) -> ToolTurnRenderer:
        key = json.dumps(tools, sort_keys=True)
        if key not in self._renderers:
            self._renderers[key] = ToolTurnRenderer(self.tok, self.kw, tools=tools)
        return self._renderers[key]

    async def _complete(self, sid: str, s: Session, req: dict) -> dict:
        msgs, max_tokens = self._check(req)
        async with s.lock:  # one request of a session at a time: each extends the last
            if s.renderer is None:
                s.renderer = self._renderer(req.get("tools") or None)
                s.prompt_ids = s.renderer.prompt_ids(msgs)
            else:
                self._extend(s, msgs)
            s.messages = list(msgs)
            budget = s.response_length - len(s.response_ids)
            if s.full or budget <= 0:
                s.full = True
                return self._answer(sid, s, req, [], "length")
            t0 = time.perf_counter()
            out = await self.server_manager.generate(request_id=sid, prompt_ids=s.prompt_ids + s.response_ids,
                                                     sampling_params={},
                                                     max_new_tokens=min(budget, max_tokens or budget))
            self.stats["engine_wait_s"] += time.perf_counter() - t0
            s.response_ids += out.token_ids
            s.response_mask += [1] * len(out.token_ids)
            s.response_logprobs += out.log_probs
            s.weight_versions.append(out.weight_version)
            s.ended_turn = out.finish_reason == "stop"
            s.num_assistant_turns += 1
            return self._answer(sid, s, req, out.token_ids, out.finish_reason)

    def _extend(self, s: Session, msgs: list[dict]) -> None:
        """Append the user/tool messages that follow the session's last assistant turn (mask 0)."""
        seen = s.messages + [{"role": "assistant"}]
        if len(msgs) <= len(seen):
            raise RequestError(f"this session has {len(seen)} messages (its last one the assistant's answer); a "
                               "request must repeat them and add user or tool messages after them.")
        for i, (a, b) in enumerate(zip(seen, msgs)):
            if a["role"] != b["role"] or (a["role"] != "assistant" and a.get("content") != b.get("content")):
                raise RequestError(f"messages[{i}] differs from the session's conversation; a session's requests "
                                   "must extend it (start a new session for a different conversation).")
        new = msgs[len(seen):]
        if any(m["role"] not in ("user", "tool") for m in new):
            raise RequestError("after the last assistant turn only user or tool messages may follow; the assistant's "
                               "turns are sampled by the engine.")
        ids = s.renderer.tool_turn_ids([{"role": m["role"], "content": _text(m.get("content"))} for m in new],
                                       ended_turn=s.ended_turn)
        if len(s.response_ids) + len(ids) >= s.response_length:
            s.full = True  # as tool_agent: a turn that would fill the budget is not appended, the last token sampled
            return
        s.response_ids += ids
        s.response_mask += [0] * len(ids)
        s.response_logprobs += [0.0] * len(ids)
        s.num_user_turns += 1

    def _answer(self, sid: str, s: Session, req: dict, ids: list[int], finish: str) -> dict:
        text = self.tok.decode(ids, skip_special_tokens=False)
        for t in (self.tok.eos_token,):  # the end-of-turn token is the template's framing, not content
            if t and text.endswith(t):
                text = text[: -len(t)]
        content, calls = tool_calls_of(text)
        msg = {"role": "assistant", "content": content or (None if calls else "")}
        if calls:
            msg["tool_calls"] = calls
            finish = "tool_calls"
        s.last_answer = msg
        n_prompt = len(s.prompt_ids) + len(s.response_ids) - len(ids)
        return {"id": f"chatcmpl-{sid}-{s.num_assistant_turns}", "object": "chat.completion",
                "created": int(time.time()), "model": req.get("model") or self.model,
                "choices": [{"index": 0, "message": msg, "finish_reason": finish, "logprobs": None}],
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(ids),
                          "total_tokens": n_prompt + len(ids)}}


def _error(message: str, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "code": None}}


def _text(content: Any) -> str:
    """A message's content as text: a string, or OpenAI's list of {type: text, text} parts."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _in_thread(coro) -> asyncio.Future:
    """Run `coro` on an event loop of its own in a daemon thread (a client that hangs cannot hold the process at
    exit, as a pool's worker would)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result, exc):
        if not fut.done():
            fut.set_exception(exc) if exc is not None else fut.set_result(result)

    def target():
        try:
            result, exc = asyncio.run(coro), None
        except BaseException as e:  # noqa: BLE001  (handed to the awaiting loop)
            result, exc = None, e
        try:
            loop.call_soon_threadsafe(settle, result, exc)
        except RuntimeError:  # the rollout's loop is gone (the client outlived its timeout)
            pass

    threading.Thread(target=target, daemon=True, name="polyrl-openai-client").start()
    return fut


_ENDPOINTS: "weakref.WeakKeyDictionary[Any, tuple[OpenAIEndpoint, list[int]]]" = weakref.WeakKeyDictionary()


async def _endpoint(loop: AgentLoopBase) -> OpenAIEndpoint:
    """The rollout's endpoint (one per server_manager), started by its first session, stopped by its last."""
    entry = _ENDPOINTS.get(loop.server_manager)
    if entry is None:
        sp = getattr(loop.server_manager, "sampling", None)
        ep = OpenAIEndpoint(loop.server_manager, loop.tokenizer, template_kwargs=getattr(loop.renderer, "kw", None),
                            temperature=getattr(sp, "temperature", None), top_p=getattr(sp, "top_p", None))
        entry = _ENDPOINTS[loop.server_manager] = (ep, [0])
    entry[1][0] += 1
    await entry[0].start()
    return entry[0]


async def _release(loop: AgentLoopBase, ep: OpenAIEndpoint) -> None:
    entry = _ENDPOINTS.get(loop.server_manager)
    entry[1][0] -= 1
    if entry[1][0] == 0:
        del _ENDPOINTS[loop.server_manager]
        await ep.stop()


@register("openai_agent")
class OpenAIAgentLoop(AgentLoopBase):
    """Runs `client(base_url, sample)` against the endpoint and returns what its session recorded. Subclass it and
    override `client`; the sample's `raw_prompt` is the conversation's start."""

    async def client(self, base_url: str, sample) -> float | None:
        raise NotImplementedError("subclass OpenAIAgentLoop and override `async def client(self, base_url, sample)`.")

    async def run(self, messages, sampling_params, **kwargs: Any) -> AgentLoopOutput:
        rid, sample = kwargs["request_id"], kwargs.get("sample")
        ep = await _endpoint(self)
        ep.open(rid, self.response_length)
        timeout, timed_out, reward = self.config.trajectory_timeout_s, False, None
        try:
            reward = await asyncio.wait_for(_in_thread(self.client(ep.session_url(rid), sample)), timeout)
        except asyncio.TimeoutError:  # the client's thread is left to end on its own; its session is closed
            timed_out = True
        finally:
            s = ep.close(rid)
            await _release(self, ep)
        if not s.response_ids:
            raise RuntimeError(f"openai_agent: the client of session {rid!r} made no chat.completions request; each "
                               "trajectory needs at least one sampled turn.")
        return AgentLoopOutput(prompt_ids=s.prompt_ids, response_ids=s.response_ids, response_mask=s.response_mask,
                               response_logprobs=s.response_logprobs,
                               num_turns=s.num_assistant_turns + s.num_user_turns + 1,
                               reward_score=None if reward is None else float(reward),
                               weight_versions=s.weight_versions, metrics={"client_timeouts": int(timed_out)},
                               messages=s.messages + [s.last_answer] if kwargs.get("keep_messages") else None)
