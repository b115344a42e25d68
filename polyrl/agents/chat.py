"""Token in, token out: the tokens of a tool turn, rendered with the chat template and appended after the sampled ones.

The sampled assistant tokens are never decoded and re-encoded into the trajectory (decode -> encode is not the
identity, and verl saw PPO fail to converge until its loop stopped doing it). Only the tool turn is tokenized: the
template renders a fixed conversation with and without the tool messages, and the text between the end of the
assistant turn (its end-of-turn token, the engine's stop token) and the end of the new generation prompt is the tool
turn. That text starts with whatever the template writes after the end-of-turn token (ChatML's "\\n", which verl's
loop once dropped, its PR #6921), holds the tool role's framing (`<|im_start|>tool` for SmolLM2's template,
`<|im_start|>user\\n<tool_response>` for Qwen's) and ends with the next assistant header; a system prompt the template
adds to every conversation appears in both renderings and so never in the delta.
"""

from __future__ import annotations

_USER, _ASSISTANT = "polyrl-user-probe", "polyrl-assistant-probe"


class ToolTurnRenderer:
    def __init__(self, tokenizer, template_kwargs: dict | None = None, tools: list[dict] | None = None):
        self.tok = tokenizer
        self.kw = dict(template_kwargs or {})
        self.tools = tools or None
        self.eot = tokenizer.eos_token or ""
        base = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
        text = self._render(base, add_generation_prompt=False)
        at = text.rfind(_ASSISTANT)
        if at < 0:
            raise ValueError("the chat template drops the assistant's content; it cannot render multi-turn rollouts.")
        end = at + len(_ASSISTANT)
        if self.eot and text.startswith(self.eot, end):
            end += len(self.eot)
        self._base, self._prefix = base, text[:end]
        self.eot_ids = tokenizer(self.eot, add_special_tokens=False)["input_ids"] if self.eot else []

    def _render(self, messages, add_generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tools=self.tools, add_generation_prompt=add_generation_prompt,
                                            tokenize=False, **self.kw)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The first turn's prompt (with the tool schemas where the template shows them)."""
        text = self._render(messages, add_generation_prompt=True)
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def tool_turn_text(self, tool_messages: list[dict]) -> str:
        full = self._render(self._base + tool_messages, add_generation_prompt=True)
        if not full.startswith(self._prefix):
            raise ValueError("the chat template renders earlier turns differently once a tool turn follows them; "
                             "multi-turn rollouts need a template whose past turns do not change.")
        return full[len(self._prefix):]

    def tool_turn_ids(self, tool_messages: list[dict], ended_turn: bool) -> list[int]:
        """Tokens appended after an assistant turn: the end-of-turn token if the turn was cut before it (a length
        stop), then the rendered tool turn and the next assistant header."""
        ids = list(self.tok(self.tool_turn_text(tool_messages), add_special_tokens=False)["input_ids"])
        return ids if ended_turn else self.eot_ids + ids
