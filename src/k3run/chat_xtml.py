"""Kimi K3's chat format ("XTML"): the prompt a K3 checkpoint expects, and its replies split into OpenAI's
reasoning, content and tool calls.

The published K3 checkpoints ship no Jinja chat template: their tokenizer carries four special tokens,
<|open|> <|close|> <|sep|> <|end_of_msg|>, and the checkpoint's own Python encoder writes every turn as
    <|open|>message role="user"<|sep|>...<|close|>message<|sep|><|end_of_msg|>
An assistant turn is a sequence of channels:
    <|open|>think<|sep|>reasoning<|close|>think<|sep|>          (only when thinking is on)
    <|open|>response<|sep|>content<|close|>response<|sep|>
    <|open|>tools<|sep|>
      <|open|>call tool="NAME" index="1"<|sep|>
        <|open|>argument key="KEY" type="string"<|sep|>raw text<|close|>argument<|sep|>
        <|open|>argument key="KEY" type="number"<|sep|>JSON<|close|>argument<|sep|>
      <|close|>call<|sep|>
    <|close|>tools<|sep|>
    <|close|>message<|sep|><|end_of_msg|>
(line breaks for reading only). Attribute values escape & and " as &amp; and &quot;; a string argument is
written raw, every other type as JSON. Tool declarations, the thinking effort, tool_choice required / none and
response_format are system messages with a `type` attribute; tool results are messages of role "tool" with
the tool's name and a 1-based index, sent in the order of the calls they answer. The generation prompt opens
an assistant message and its first channel (think, or response when thinking is off).

This module is k3run's own implementation of that format (as described by the public parsers and ports of
the encoder); it renders a conversation as segments, each tokenized on its own (markup segments are single
special tokens, text segments ordinary text: a user cannot write structure), which is how the encoder
tokenizes. Rules for parsing a reply (the same for a whole output and a stream):
- reasoning: the think channel's body; content: the response channel's body;
- tool calls (only when the request gave tools): the tools channel must close, every call name one of the
  request's tools and every argument parse by its type, else the channel's text is returned as content,
  as the model wrote it: never an error;
- the message's closing tags and <|end_of_msg|> are dropped; any other text outside a channel is content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from k3run.chat_output import ChatOutput, DeltaStream, ToolCall, _held, special_token_id

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
MARKERS = (OPEN, CLOSE, SEP, END_OF_MSG)
THINK_OPEN, THINK_CLOSE = f"{OPEN}think{SEP}", f"{CLOSE}think{SEP}"
RESPONSE_OPEN, RESPONSE_CLOSE = f"{OPEN}response{SEP}", f"{CLOSE}response{SEP}"
TOOLS_OPEN, TOOLS_CLOSE = f"{OPEN}tools{SEP}", f"{CLOSE}tools{SEP}"
CALL_CLOSE, ARGUMENT_CLOSE = f"{CLOSE}call{SEP}", f"{CLOSE}argument{SEP}"
MESSAGE_CLOSE = f"{CLOSE}message{SEP}"
# the thinking efforts the format declares to the model (OpenAI's reasoning_effort "none" turns thinking off)
EFFORTS = ("low", "high", "max")


class XtmlError(ValueError):
    """A conversation the format cannot express; `field` names the request field at fault."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def is_xtml(tokenizer: Any) -> bool:
    """Whether the tokenizer has K3's four markup tokens (each a single special token)."""
    return all(special_token_id(tokenizer, m) is not None for m in MARKERS)


@dataclass(frozen=True)
class Segment:
    text: str
    markup: bool = False  # a single special token


def _open(tag: str, attrs: Sequence[tuple[str, Any]] = ()) -> list[Segment]:
    out = [Segment(OPEN, True), Segment(tag)]
    for key, value in attrs:
        escaped = str(value).replace("&", "&amp;").replace('"', "&quot;")
        out += [Segment(f" {key}"), Segment('="'), Segment(escaped), Segment('"')]
    return out + [Segment(SEP, True)]


def _close(tag: str) -> list[Segment]:
    return [Segment(CLOSE, True), Segment(tag), Segment(SEP, True)]


def _message(attrs: Sequence[tuple[str, Any]], body: list[Segment]) -> list[Segment]:
    return _open("message", attrs) + body + _close("message") + [Segment(END_OF_MSG, True)]


def _text(text: Any) -> list[Segment]:
    return [Segment(str(text))] if text not in (None, "") else []


def _sorted(value: Any) -> Any:
    """Mappings sorted by key, recursively (the declarations' canonical form)."""
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    return value


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _system_note(kind: str, body: str) -> list[Segment]:
    return _message([("role", "system"), ("type", kind)], _text(body.strip()))


def _arg_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def _assistant(m: dict[str, Any], at: str, thinking: bool) -> list[Segment]:
    body: list[Segment] = []
    if thinking:  # the think channel is always there when thinking is on, empty or not
        reasoning = m.get("reasoning_content")
        body += (
            _open("think") + (_text(reasoning) if reasoning and reasoning.strip() else []) + _close("think")
        )
    body += _open("response") + _text(m.get("content")) + _close("response")
    calls = m.get("tool_calls") or []
    if calls:
        body += _open("tools")
        for j, c in enumerate(calls, start=1):
            fn = c["function"]
            body += _open("call", [("tool", fn["name"]), ("index", j)])
            raw = fn.get("arguments") or ""
            try:
                args = json.loads(raw) if raw.strip() else {}
            except ValueError:  # the model wrote invalid JSON once: shown back as it was written
                args = None
            if args is None:
                body += _open("json", [("type", "object")]) + _text(raw) + _close("json")
            elif not isinstance(args, dict):
                raise XtmlError(
                    f"{at}.tool_calls[{j - 1}].function.arguments must be a JSON object",
                    f"{at}.tool_calls[{j - 1}].function.arguments",
                )
            else:
                for key, value in args.items():
                    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
                    body += _open("argument", [("key", key), ("type", _arg_type(value))]) + _text(text)
                    body += _close("argument")
            body += _close("call")
        body += _close("tools")
    return body


def _tool_runs(messages: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any], str, int]]:
    """(position in messages, message, tool name, call position) of each tool message, each run of tool
    messages sorted by the position of the call it answers in the preceding assistant turn (the format
    binds a result to its call by position; OpenAI clients bind by tool_call_id, in any order)."""
    out: list[tuple[int, dict[str, Any], str, int]] = []
    calls: dict[str, tuple[int, str]] = {}
    run: list[tuple[int, dict[str, Any], str, int]] = []
    for i, m in enumerate([*messages, {"role": "end"}]):
        if m["role"] == "tool":
            found = calls.get(m["tool_call_id"])
            if found is None:
                raise XtmlError(
                    f"messages[{i}].tool_call_id {m['tool_call_id']!r} answers no tool call of the assistant "
                    "turn before it", f"messages[{i}].tool_call_id",
                )  # fmt: skip
            run.append((i, m, found[1], found[0]))
            continue
        out += sorted(run, key=lambda r: (r[3], r[0]))
        run = []
        if m["role"] == "assistant":
            calls = {}
            for j, c in enumerate(m.get("tool_calls") or [], start=1):
                calls.setdefault(c["id"], (j, c["function"]["name"]))
    return out


def render(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    thinking: bool = True,
    effort: str | None = None,
    tool_choice: str = "auto",
    response_schema: dict[str, Any] | None = None,
    json_object: bool = False,
) -> list[Segment]:
    """The segments of a conversation (OpenAI messages as the server checked them: role, content as text,
    tool_calls, tool_call_id) and its generation prompt. tool_choice "required" / "none" and a response
    format are told to the model in system messages after the conversation, as the format does."""
    out: list[Segment] = []
    if tools:
        out += _system_note(
            "tool-declare",
            "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
            f"```json\n{_compact(_sorted(tools))}\n```",
        )
    if thinking and effort is not None:
        if effort not in EFFORTS:
            raise XtmlError(
                f"'reasoning_effort' must be one of none, {', '.join(EFFORTS)} for this model, "
                f"got {effort!r}",
                "reasoning_effort",
            )
        out += _system_note(
            "thinking-effort",
            "`thinking_effort` guides on how much to think in your thinking channel (not including the "
            "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
            f"Now the system is invoked with `thinking_effort={effort}`.",
        )
    tool_order = iter(_tool_runs(messages))
    results = 0  # tool results since the last assistant turn: a result's index counts them
    for i, m in enumerate(messages):
        role = m["role"]
        if role in ("user", "system"):
            out += _message([("role", role)], _text(m.get("content")))
        elif role == "assistant":
            out += _message([("role", "assistant")], _assistant(m, f"messages[{i}]", thinking))
            results = 0
        elif role == "tool":  # results in the order of their calls (see _tool_runs)
            _, tm, name, _ = next(tool_order)
            results += 1
            out += _message([("role", "tool"), ("tool", name), ("index", results)], _text(tm.get("content")))
        else:
            raise XtmlError(f"messages[{i}].role {role!r} has no place in this format", f"messages[{i}].role")
    if tool_choice in ("required", "none"):
        must = "MUST call tools" if tool_choice == "required" else "MUST NOT call any tools"
        out += _system_note(
            "tool-choice",
            f"The system is invoked with `tool_choice={tool_choice}`.\nYou {must} in the next message.",
        )
    if response_schema is not None or json_object:
        kind = "json_object" if response_schema is None else "json_schema"
        note = (
            f"The system is invoked with `response_format={kind}`.\nYour response must be raw JSON data "
            "without markdown code blocks (```json) or any additional formatting."
        )
        if response_schema is not None:
            schema = _compact(_sorted(response_schema))
            note += f"\nThe JSON data must match the following schema:\n```json\n{schema}\n```"
        out += _system_note("response-format", note)
    return out + _open("message", [("role", "assistant")]) + _open("think" if thinking else "response")


def encode(tokenizer: Any, segments: list[Segment]) -> list[int]:
    """Token ids of segments: each markup segment its special token, each text segment encoded on its own as
    ordinary text."""
    ids: list[int] = []
    for s in segments:
        if s.markup:
            tid = tokenizer.token_to_id(s.text)
            if tid is None:
                raise XtmlError(f"the tokenizer has no {s.text} token")
            ids.append(tid)
        else:
            ids += tokenizer.encode_text(s.text)
    return ids


def to_text(segments: list[Segment]) -> str:
    return "".join(s.text for s in segments)


# ---- replies ----


@dataclass(frozen=True)
class XtmlOptions:
    """What to look for in a reply. thinking: the prompt opened the think channel; names: the request's tool
    names (empty: no tool parsing)."""

    thinking: bool = True
    names: frozenset[str] = frozenset()
    parallel: bool = True


_CALL = re.compile(
    r'<\|open\|>call tool="([^"]*)" index="([0-9]+)"<\|sep\|>(.*?)<\|close\|>call<\|sep\|>', re.S
)
_ARG = re.compile(
    r'<\|open\|>argument key="([^"]*)" type="([a-z]+)"<\|sep\|>(.*?)<\|close\|>argument<\|sep\|>', re.S
)
_JSON_ARG = re.compile(r'<\|open\|>json type="object"<\|sep\|>(.*?)<\|close\|>json<\|sep\|>', re.S)


def _unescape(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def _arg_value(text: str, kind: str) -> Any:
    if kind == "string":
        return text
    value = json.loads(text)  # ValueError: not a value of any type
    ok = {
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
        "null": value is None,
        "object": isinstance(value, dict),
        "array": isinstance(value, list),
    }.get(kind)
    if not ok:
        raise ValueError(f"{text!r} is not of type {kind}")
    return value


def parse_tools(body: str, names: frozenset[str]) -> list[ToolCall] | None:
    """The calls of a tools channel's body, or None if any part of it is malformed."""
    calls: list[ToolCall] = []
    pos = 0
    for m in _CALL.finditer(body):
        if body[pos : m.start()].strip():
            return None
        pos = m.end()
        name, index, inner = _unescape(m.group(1)), m.group(2), m.group(3)
        if name not in names:
            return None
        args: dict[str, Any] = {}
        whole = _JSON_ARG.fullmatch(inner.strip())
        try:
            if whole is not None:
                parsed = json.loads(whole.group(1))
                if not isinstance(parsed, dict):
                    return None
                args = parsed
            else:
                at = 0
                for a in _ARG.finditer(inner):
                    if inner[at : a.start()].strip():
                        return None
                    at = a.end()
                    args[_unescape(a.group(1))] = _arg_value(a.group(3), a.group(2))
                if inner[at:].strip():
                    return None
        except ValueError:
            return None
        calls.append(ToolCall(f"functions.{name}:{index}", name, json.dumps(args, ensure_ascii=False)))
    if body[pos:].strip() or not calls:
        return None
    return calls


class XtmlStreamParser(DeltaStream):
    """A K3 reply over a stream (chat_output.DeltaStream; the module's rules). Text that could still be the
    start of a closing tag is held back; a tools channel is held until it closes. No empty delta is made."""

    def __init__(self, opts: XtmlOptions) -> None:
        super().__init__("think" if opts.thinking else "response")
        self.opts = opts

    def _step(self, final: bool) -> list[dict[str, Any]]:
        return [d for d in self._next(final) if any(d.values())]

    def _body(self, key: str, close: str, then: str, final: bool) -> list[dict[str, Any]]:
        """Emit a channel's body up to its closing tag (held back: what could begin it)."""
        i = self.buf.find(close)
        if i >= 0:
            piece, self.buf = self.buf[:i], self.buf[i + len(close) :]
            self.state = then
            return [{key: piece}]
        n = len(self.buf) - (0 if final else _held(self.buf, close))
        piece, self.buf = self.buf[:n], self.buf[n:]
        return [{key: piece}]

    def _between(self, final: bool) -> list[dict[str, Any]]:
        """Between channels: the next opening tag, the message's end, or stray text (content)."""
        rest = self.buf.lstrip()
        opens = [(RESPONSE_OPEN, "response"), (MESSAGE_CLOSE, "end"), (END_OF_MSG, "end")]
        if self.opts.names:
            opens.append((TOOLS_OPEN, "tools"))
        for tag, state in opens:
            if rest.startswith(tag):
                self.buf, self.state = rest[len(tag) :], state
                return []
        if not final and (not rest or any(tag.startswith(rest) for tag, _ in opens)):
            return []  # could still become a tag
        cut = min([i for i in (rest.find(t) for t, _ in opens) if i > 0], default=len(rest))
        piece, self.buf = rest[:cut], rest[cut:]
        return [{"content": piece}]

    def _next(self, final: bool) -> list[dict[str, Any]]:
        if self.state == "think":
            return [{"reasoning_content": d["r"]} for d in self._body("r", THINK_CLOSE, "between", final)]
        if self.state == "response":
            return self._body("content", RESPONSE_CLOSE, "between", final)
        if self.state == "between":
            return self._between(final)
        if self.state == "tools":
            body, sep, _ = self.buf.partition(TOOLS_CLOSE)
            if not sep and not final:
                return []
            parsed = parse_tools(body, self.opts.names) if sep else None
            if parsed is None:  # not valid: the channel's text is content, as written
                text = TOOLS_OPEN + self.buf
                self.buf, self.state = "", "tail"
                return [{"content": text}]
            self.buf, self.state = self.buf[len(body) + len(TOOLS_CLOSE) :], "between"
            self.calls = parsed if self.opts.parallel else parsed[:1]
            return [{"tool_calls": [c.openai(i) for i, c in enumerate(self.calls)]}]
        if self.state == "end":  # after the message closed: only the end-of-message token belongs here
            keep = 0 if final else _held(self.buf, END_OF_MSG)
            rest, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
            rest = rest.replace(END_OF_MSG, "")
            return [{"content": rest}] if rest.strip() else []
        piece, self.buf = self.buf, ""  # tail: after an invalid tools channel, all text is content
        return [{"content": piece}]


def parse_output(text: str, opts: XtmlOptions) -> ChatOutput:
    """A whole reply (special tokens kept): the stream parser's deltas, joined."""
    p = XtmlStreamParser(opts)
    deltas = p.feed(text) + p.finish()
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    return ChatOutput(reasoning if opts.thinking else None, content, p.calls)


# ---- constrained replies ----


def reply_structure(
    tokenizer: Any,
    *,
    thinking: bool,
    tools: list[dict[str, Any]] | None = None,
    parallel: bool = True,
    response_schema: dict[str, Any] | None = None,
) -> str:
    """The structure (engine/grammar.py) of a reply that must call the given tools (tool_choice required or
    named: one or more calls, each argument held to the tool's schema), or whose response must be JSON of
    `response_schema`. The think channel (when open) and the response channel's free text stay free."""
    ids = {m: tokenizer.token_to_id(m) for m in MARKERS}
    o, c, s = ({"token": ids[m]} for m in (OPEN, CLOSE, SEP))

    def close(tag: str) -> list[dict[str, Any]]:
        return [c, {"text": tag}, s]

    free = {"any_text": [OPEN, CLOSE, SEP, END_OF_MSG]}
    seq: list[dict[str, Any]] = []
    if thinking:
        seq += [free, *close("think"), o, {"text": "response"}, s]
    if response_schema is not None:
        seq += [{"json": response_schema}, *close("response")]
    else:
        seq += [free, *close("response")]
    if tools:
        calls = []
        for t in tools:
            fn = t["function"]
            name = fn["name"].replace("&", "&amp;").replace('"', "&quot;")
            calls.append({"seq": [
                o, {"text": f'call tool="{name}" index="'}, {"regex": "[1-9][0-9]{0,2}"}, {"text": '"'}, s,
                {"json": fn.get("parameters") or {"type": "object"}, "style": "kimi_k3_xml",
                 "excludes": MARKERS},
                *close("call"),
            ]})  # fmt: skip
        one: dict[str, Any] = calls[0] if len(calls) == 1 else {"or": calls}
        seq += [o, {"text": "tools"}, s, {"plus": one} if parallel else one, *close("tools")]
    seq += close("message")
    return json.dumps({"seq": seq})
