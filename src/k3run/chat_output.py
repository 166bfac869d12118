"""What a Kimi chat model writes, split into OpenAI's fields: reasoning, content and tool calls.

Kimi's chat templates (K2, K3, Kimi Linear) frame an assistant turn as
    [<think> reasoning </think>] content [<|tool_calls_section_begin|> call ... <|tool_calls_section_end|>]
with each call written as
    <|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{json arguments}<|tool_call_end|>
The call id (`functions.NAME:INDEX`) is what the template renders back with the tool's result, so it is
kept as the OpenAI `tool_calls[].id`. The markers are special tokens: the text parsed here is decoded with
special tokens kept (`incremental_decode(..., skip_special_tokens=False)`).

Rules (the same for a whole output and for a stream):
- reasoning: the text up to `</think>` when the prompt ended in `<think>` (the template opened it) or the
  output starts with it; an output that never closes it is all reasoning.
- a forced call (tool_choice naming a tool): the prompt already opened the call, so the whole reply is its
  arguments (the sampler holds it to the tool's schema);
- tool_choice "required": the prompt already opened the tool-calls section, so the whole reply is its calls
  (the sampler holds it to `calls_structure`: one or more calls of the request's tools, each to its schema);
- tool calls (only when the request gave tools and tool_choice is "auto"): the section must be closed,
  every call well formed, its arguments a JSON object and its name one of the request's tools. Otherwise the
  section's text is returned as content, as the model wrote it: never an error. With parallel_tool_calls
  false only the first call is returned.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

THINK_BEGIN, THINK_END = "<think>", "</think>"
SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARG_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def incremental_decode(
    tokenizer: Any, ids: Sequence[int], prefix: int, read: int, flush: bool, skip_special_tokens: bool = True
) -> tuple[str, int, int]:
    """(new text, prefix, read) for ids decoded up to `read` before: the window from `prefix` is decoded
    again so multi-byte characters and word-start spaces come out right, and text is held back while the
    window ends in an incomplete UTF-8 sequence (unless `flush`)."""
    before = tokenizer.decode(ids[prefix:read], skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(ids[prefix:], skip_special_tokens=skip_special_tokens)
    if len(full) > len(before) and (flush or not full.endswith("\ufffd")):
        return full[len(before) :], read, len(ids)
    return "", prefix, read


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as the model wrote it

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index} | out


@dataclass
class ChatOutput:
    reasoning: str | None
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)


def parse_section(body: str, names: frozenset[str]) -> list[ToolCall] | None:
    """The calls of one tool-calls section (the text between its markers), or None if any is malformed."""
    calls = []
    rest = body.strip()
    while rest:
        if not rest.startswith(CALL_BEGIN) or CALL_END not in rest:
            return None
        call, rest = rest[len(CALL_BEGIN) :].split(CALL_END, 1)
        rest = rest.strip()
        if call.count(ARG_BEGIN) != 1:
            return None
        ident, args = (s.strip() for s in call.split(ARG_BEGIN))
        head, sep, index = ident.rpartition(":")
        name = head.removeprefix("functions.")
        if not sep or not index.isdigit() or name not in names:
            return None
        try:
            parsed = json.loads(args)
        except ValueError:
            return None
        if not isinstance(parsed, dict):
            return None
        calls.append(ToolCall(ident, name, args))
    return calls or None


@dataclass(frozen=True)
class ParseOptions:
    """What to look for in an output. names: the request's tool names (empty: no tool parsing)."""

    think_open: bool = False  # the prompt ended in <think>
    names: frozenset[str] = frozenset()
    parallel: bool = True
    # (call id, name) when the prompt already opened that tool call (tool_choice named): the whole reply is
    # its arguments, constrained to the tool's schema
    forced: tuple[str, str] | None = None
    section_open: bool = False  # the prompt opened the tool-calls section (tool_choice "required")


def _forced(text: str, opts: ParseOptions) -> ChatOutput:
    """The reply to a prompt that opened a tool call: its arguments, or text if they are not a JSON object."""
    assert opts.forced is not None
    args = text.strip()
    try:
        ok = isinstance(json.loads(args), dict)
    except ValueError:
        ok = False
    return ChatOutput(None, "", [ToolCall(*opts.forced, args)]) if ok else ChatOutput(None, text, [])


def _opened_section(text: str, opts: ParseOptions) -> ChatOutput:
    """The reply to a prompt that opened the tool-calls section: its calls, or text if they are not valid."""
    body, sep, _ = text.partition(SECTION_END)
    parsed = parse_section(body, opts.names) if sep else None
    if parsed is None:
        return ChatOutput(None, text, [])
    return ChatOutput(None, "", parsed if opts.parallel else parsed[:1])


def special_token_id(tokenizer: Any, marker: str) -> int | None:
    """The id of the one token that is `marker` (a chat format's special token), or None if the tokenizer
    has no such token (it spells the marker in text)."""
    tid = tokenizer.token_to_id(marker)
    if tid is not None and tokenizer.decode([tid], skip_special_tokens=False) == marker:
        return tid
    return None


def _marker(tokenizer: Any, marker: str) -> dict[str, Any]:
    """A structure node for a marker: its special token, or its text where the tokenizer spells it."""
    tid = special_token_id(tokenizer, marker)
    return {"text": marker} if tid is None else {"token": tid}


def calls_structure(tokenizer: Any, tools: list[dict[str, Any]], parallel: bool) -> str:
    """The structure (engine/grammar.py) of a tool-calls section's body after its opening marker: one call
    (or, with parallel, one or more) of the given tools, each written as
    <|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{arguments}<|tool_call_end|>
    with compact JSON arguments held to the tool's parameter schema, then the section's end marker."""
    calls = []
    for t in tools:
        fn = t["function"]
        calls.append({"seq": [
            _marker(tokenizer, CALL_BEGIN), {"text": f"functions.{fn['name']}:"}, {"regex": "[0-9]{1,3}"},
            _marker(tokenizer, ARG_BEGIN), {"json": fn.get("parameters") or {"type": "object"}},
            _marker(tokenizer, CALL_END),
        ]})  # fmt: skip
    one: dict[str, Any] = calls[0] if len(calls) == 1 else {"or": calls}
    return json.dumps({"seq": [{"plus": one} if parallel else one, _marker(tokenizer, SECTION_END)]})


def parse_output(text: str, opts: ParseOptions) -> ChatOutput:
    """A whole output (special tokens kept) as reasoning, content and tool calls (module rules)."""
    if opts.forced is not None:
        return _forced(text, opts)
    if opts.section_open:
        return _opened_section(text, opts)
    reasoning = None
    if opts.think_open or text.lstrip().startswith(THINK_BEGIN):
        inner = text if opts.think_open else text.lstrip()[len(THINK_BEGIN) :]
        reasoning, sep, text = inner.partition(THINK_END)
        if not sep:
            reasoning, text = inner, ""
        text = text.lstrip("\n") if sep else text
    calls: list[ToolCall] = []
    if opts.names and SECTION_BEGIN in text:
        before, after = text.split(SECTION_BEGIN, 1)
        body, sep, tail = after.partition(SECTION_END)
        parsed = parse_section(body, opts.names) if sep else None
        if parsed is not None:
            calls = parsed if opts.parallel else parsed[:1]
            text = before + tail
    return ChatOutput(reasoning, text, calls)


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """text up to the first occurrence of any stop string (the engine's rule on its own text)."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(hits)] if hits else text


class StopCut:
    """cut_at_stop over a stream: feed(new_text, final) returns what is safe to pass on (the characters that
    could still begin a stop string are held back), nothing after a stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.buf = ""
        self.done = False

    def feed(self, text: str, final: bool) -> str:
        if self.done:
            return ""
        self.buf += text
        cut = cut_at_stop(self.buf, self.stops)
        if len(cut) < len(self.buf):
            self.done, self.buf = True, ""
            return cut
        keep = 0 if final or not self.stops else max(len(s) for s in self.stops) - 1
        out, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
        return out


def _held(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (held back in a stream)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class DeltaStream:
    """A reply parser over a stream, as a state machine: `feed(new_text)` and `finish()` run `_step(final)`
    until it neither changes state nor consumes text, and return the OpenAI delta fields it made
    ({"reasoning_content": ...}, {"content": ...}, {"tool_calls": [...]}) in order; `calls` holds the tool
    calls returned. Subclasses (one per chat format) write `_step`."""

    def __init__(self, state: str) -> None:
        self.state = state
        self.buf = ""
        self.calls: list[ToolCall] = []

    def _step(self, final: bool) -> list[dict[str, Any]]:
        raise NotImplementedError

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> list[dict[str, Any]]:
        return [d for d in self._run(final=True) if any(d.values())]

    def _run(self, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            before = (self.state, len(self.buf))
            out += self._step(final)
            if (self.state, len(self.buf)) == before:
                return out


class StreamParser(DeltaStream):
    """parse_output's rules over a stream (DeltaStream). Text that could still be the start of a marker is
    held back; a tool-calls section is held until it closes (its calls then go out together, or its text as
    content if it is not valid)."""

    def __init__(self, opts: ParseOptions) -> None:
        super().__init__("think" if opts.think_open else "start")
        self.opts = opts

    def _emit(self, key: str, upto: int) -> list[dict[str, Any]]:
        piece, self.buf = self.buf[:upto], self.buf[upto:]
        return [{key: piece}] if piece else []

    def _step(self, final: bool) -> list[dict[str, Any]]:
        if self.opts.forced is not None:
            return self._forced_call(final)
        if self.opts.section_open:
            return self._held_section(final)
        step = {
            "start": self._start, "think": self._think, "after_think": self._after_think,
            "content": self._content, "section": self._section,
        }.get(self.state, self._content_only)  # fmt: skip
        return step(final)

    def _forced_call(self, final: bool) -> list[dict[str, Any]]:
        """The arguments of the call the prompt opened: held to the end."""
        if not final or self.state == "done":
            return []
        self.state = "done"
        co = _forced(self.buf, self.opts)
        self.buf, self.calls = "", co.tool_calls
        if co.tool_calls:
            return [{"tool_calls": [co.tool_calls[0].openai(0)]}]
        return [{"content": co.content}]

    def _held_section(self, final: bool) -> list[dict[str, Any]]:
        """The calls of the tool-calls section the prompt opened: held to its end."""
        if self.state == "done" or (not final and SECTION_END not in self.buf):
            return []
        self.state = "done"
        co = _opened_section(self.buf, self.opts)
        self.buf, self.calls = "", co.tool_calls
        if co.tool_calls:
            return [{"tool_calls": [c.openai(i) for i, c in enumerate(co.tool_calls)]}]
        return [{"content": co.content}]

    def _start(self, final: bool) -> list[dict[str, Any]]:
        """Does the output open a reasoning block?"""
        stripped = self.buf.lstrip()
        if stripped.startswith(THINK_BEGIN):
            self.buf, self.state = stripped[len(THINK_BEGIN) :], "think"
        elif final or not THINK_BEGIN.startswith(stripped):
            self.state = "content"
        return []

    def _think(self, final: bool) -> list[dict[str, Any]]:
        i = self.buf.find(THINK_END)
        if i >= 0:
            out = self._emit("reasoning_content", i)
            self.buf = self.buf[len(THINK_END) :]
            self.state = "after_think"
            return out
        return self._emit("reasoning_content", len(self.buf) - (0 if final else _held(self.buf, THINK_END)))

    def _after_think(self, final: bool) -> list[dict[str, Any]]:
        """The newlines right after </think> are not content."""
        self.buf = self.buf.lstrip("\n")
        if self.buf or final:
            self.state = "content"
        return []

    def _content(self, final: bool) -> list[dict[str, Any]]:
        if self.opts.names:
            i = self.buf.find(SECTION_BEGIN)
            if i >= 0:
                out = self._emit("content", i)
                self.state = "section"
                return out
            return self._emit("content", len(self.buf) - (0 if final else _held(self.buf, SECTION_BEGIN)))
        return self._emit("content", len(self.buf))

    def _section(self, final: bool) -> list[dict[str, Any]]:
        body, sep, _ = self.buf[len(SECTION_BEGIN) :].partition(SECTION_END)
        if not sep and not final:
            return []
        parsed = parse_section(body, self.opts.names) if sep else None
        if parsed is None:  # not valid: the section's text is content
            self.state = "content_only"
            return self._emit("content", len(self.buf))
        self.calls = parsed if self.opts.parallel else parsed[:1]
        self.buf = self.buf[len(SECTION_BEGIN) + len(body) + len(SECTION_END) :]
        self.state = "content_only"
        return [{"tool_calls": [c.openai(i) for i, c in enumerate(self.calls)]}]

    def _content_only(self, final: bool) -> list[dict[str, Any]]:
        """After the section: everything is content."""
        return self._emit("content", len(self.buf))
