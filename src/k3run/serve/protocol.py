"""The OpenAI protocol: request fields checked one by one against what each endpoint implements (a bad
field is a `ServeError` 400 naming it, in OpenAI's error shape), `SamplingParams` from a request body, and
the response pieces (logprobs in the completions and chat shapes, finish reasons, usage).

Plain functions with no engine state: the checks read the body alone (`requests.RequestParser` adds the
tokenizer's and the model's limits), the logprobs pieces take the tokenizer to spell tokens.
"""

import json
from typing import Any

from k3run.engine import SamplingParams
from k3run.engine.sequence import MAX_LOGPROBS, FinishReason, RequestOutput, TokenLogprob

MAX_CHOICES = 64  # prompts x n per request


class ServeError(Exception):
    """An error for the client: HTTP status, OpenAI error type, the offending field."""

    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "an integer", float: "a number",
               bool: "a boolean"}  # fmt: skip


def get_field(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any) -> Any:
    """body[name] if present and one of `kinds` (a bool never passes for a number), else a 400 naming it."""
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
        want = " or ".join(_JSON_TYPES.get(k, k.__name__) for k in kinds)
        raise ServeError(
            400, f"'{name}' must be {want}, got {_JSON_TYPES.get(type(v), type(v).__name__)}", name
        )
    return v


_UNSUPPORTED = {"best_of": (None, 1), "suffix": (None, ""), "logit_bias": (None, {})}
# the fields each endpoint reads; `user` (an end-user id for the caller's own records) has no effect on the
# output, as in OpenAI's API
_COMMON_FIELDS = {
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
    "presence_penalty", "frequency_penalty", "logit_bias", "user", "logprobs", "top_k", "ignore_eos",
    "stop_token_ids",
}  # fmt: skip
_FIELDS = {
    False: _COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix"},
    True: _COMMON_FIELDS
    | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"}
    | {"reasoning_effort", "response_format"},
}
# OpenAI fields this server does not implement: refused by name, never ignored
_NOT_IMPLEMENTED = (
    "functions", "function_call", "modalities", "audio", "prediction",
    "web_search_options", "store", "metadata", "service_tier", "min_p", "repetition_penalty",
)  # fmt: skip
# the keys a message of each role may carry
_ROLE_KEYS = {
    "system": ("role", "content"),
    "user": ("role", "content"),
    "assistant": ("role", "content", "tool_calls", "reasoning_content"),
    "tool": ("role", "content", "tool_call_id"),
}
_ROLES = tuple(_ROLE_KEYS)
EFFORTS = ("low", "medium", "high")  # for Jinja templates; K3's format has its own (chat_xtml.EFFORTS)


def check_fields(body: dict[str, Any], chat: bool) -> None:
    """A 400 naming the first field that this endpoint does not read."""
    for name in body:
        if name in _FIELDS[chat]:
            continue
        if name == "echo" and chat:
            raise ServeError(400, "'echo' is a /v1/completions field", "echo")
        if not chat and name in _FIELDS[True]:
            raise ServeError(400, f"'{name}' is a /v1/chat/completions field", name)
        if name in _NOT_IMPLEMENTED:
            raise ServeError(400, f"'{name}' is not supported by this server", name)
        other = "/v1/completions" if name in _FIELDS[False] else "/v1/chat/completions"
        where = f"; it is a {other} field" if name in _FIELDS[not chat] else ""
        raise ServeError(400, f"unknown field '{name}'{where}", name)


def _text(i: int, m: dict[str, Any], nullable: bool) -> dict[str, Any]:
    """Message i with its content as one string (text parts joined); None kept where allowed."""
    content = m.get("content")
    if content is None and nullable:
        return m
    if isinstance(content, list):  # text parts only
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise ServeError(
                400, f"messages[{i}].content: only text parts are supported", f"messages[{i}].content"
            )
        return {**m, "content": "".join(str(p.get("text", "")) for p in content)}
    if not isinstance(content, str):
        raise ServeError(400, f"messages[{i}].content must be a string", f"messages[{i}].content")
    return m


def check_message(i: int, m: Any) -> dict[str, Any]:
    """Message i checked field by field (roles system / user / assistant / tool, _ROLE_KEYS)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ServeError(400, f"{where} must be an object with a string 'role'", f"{where}.role")
    role = m["role"]
    if role not in _ROLES:
        raise ServeError(
            400, f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}", f"{where}.role"
        )
    for key in m:
        if key not in _ROLE_KEYS[role]:
            raise ServeError(
                400, f"{where}.{key} is not supported by this server for role {role!r}", f"{where}.{key}"
            )
    calls = m.get("tool_calls")
    if calls is not None:
        _check_tool_calls(where, calls)
    if role == "assistant" and m.get("reasoning_content") is not None:
        if not isinstance(m["reasoning_content"], str):
            raise ServeError(400, f"{where}.reasoning_content must be a string", f"{where}.reasoning_content")
    if role == "tool" and not isinstance(m.get("tool_call_id"), str):
        raise ServeError(400, f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
    return _text(i, m, nullable=role == "assistant" and calls is not None)


def _check_tool_calls(where: str, calls: Any) -> None:
    """An assistant message's tool_calls: a non-empty list of {'id', 'type': 'function', 'function':
    {'name', 'arguments'}} with string values."""
    if not isinstance(calls, list) or not calls:
        raise ServeError(400, f"{where}.tool_calls must be a non-empty list", f"{where}.tool_calls")
    for j, c in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if (
            not isinstance(fn, dict)
            or not isinstance(c.get("id"), str)
            or c.get("type", "function") != "function"
            or not isinstance(fn.get("name"), str)
            or not isinstance(fn.get("arguments"), str)
        ):
            raise ServeError(
                400, f"{at} must be {{'id': str, 'type': 'function', 'function': {{'name': str, "
                "'arguments': str}}}}", at,
            )  # fmt: skip


def check_tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's tools: [{"type": "function", "function": {"name", "description"?, "parameters"?}}]."""
    tools = get_field(body, "tools", (list,), [])
    names = set()
    for i, t in enumerate(tools):
        at = f"tools[{i}]"
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or t.get("type") != "function":
            raise ServeError(400, f"{at} must be {{'type': 'function', 'function': {{...}}}}", at)
        for key in t:
            if key not in ("type", "function"):
                raise ServeError(400, f"{at}.{key} is not supported", f"{at}.{key}")
        name = fn.get("name")
        if not isinstance(name, str) or not name or not all(ch.isalnum() or ch in "_-." for ch in name):
            raise ServeError(
                400, f"{at}.function.name must be a non-empty string of letters, digits, _ - .",
                f"{at}.function.name",
            )  # fmt: skip
        if name in names:
            raise ServeError(400, f"{at}.function.name {name!r} is given twice", f"{at}.function.name")
        names.add(name)
        for key, kinds in (("description", (str,)), ("parameters", (dict,)), ("strict", (bool,))):
            if key in fn and not isinstance(fn[key], kinds):
                raise ServeError(400, f"{at}.function.{key} has the wrong type", f"{at}.function.{key}")
        if fn.get("strict"):
            raise ServeError(
                400, "strict tool schemas need constrained decoding, which this server does not implement",
                f"{at}.function.strict",
            )  # fmt: skip
        for key in fn:
            if key not in ("name", "description", "parameters", "strict"):
                raise ServeError(400, f"{at}.function.{key} is not supported", f"{at}.function.{key}")
    return tools


def tool_choice(body: dict[str, Any], tools: list[dict[str, Any]]) -> str | dict[str, Any]:
    """ "auto", "none", "required", or the tool the reply must call (a named function)."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required") and not tools:
        raise ServeError(400, f"'tool_choice' {choice!r} needs 'tools'", "tool_choice")
    if choice in ("auto", "none"):
        return choice
    if choice == "required":
        return choice
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if isinstance(fn, dict) and isinstance(fn.get("name"), str):
        for t in tools:
            if t["function"]["name"] == fn["name"]:
                return t
        raise ServeError(400, f"'tool_choice' names {fn['name']!r}, which is not in 'tools'", "tool_choice")
    raise ServeError(
        400, "'tool_choice' must be 'auto', 'none', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}", "tool_choice",
    )  # fmt: skip


def response_schema(body: dict[str, Any]) -> str | None:
    """The JSON schema (as text) `response_format` asks for: None for text, {"type": "object"} for any JSON
    object, or the request's schema."""
    fmt = get_field(body, "response_format", (dict,), None)
    if fmt is None or fmt.get("type") == "text":
        return None

    kind = fmt.get("type")
    if kind == "json_object":
        schema: dict[str, Any] = {"type": "object"}
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ServeError(
                400, "response_format.json_schema must be {'name': str, 'schema': {...}, 'strict'?: bool}",
                "response_format.json_schema",
            )  # fmt: skip
        for key in spec:
            if key not in ("name", "schema", "strict", "description"):
                raise ServeError(
                    400,
                    f"response_format.json_schema.{key} is not supported",
                    f"response_format.json_schema.{key}",
                )
        schema = spec.get("schema", {})
    else:
        raise ServeError(
            400, f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            "response_format.type",
        )  # fmt: skip
    return json.dumps(schema)  # key order kept: it is the order of the properties in the output


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many top alternatives to report (None: no logprobs). Completions: `logprobs` is that number;
    chat: `logprobs` is a flag and `top_logprobs` the number."""
    if chat:
        if not get_field(body, "logprobs", (bool,), False):
            if body.get("top_logprobs") not in (None, 0):
                raise ServeError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
            return None
        k, name = get_field(body, "top_logprobs", (int,), 0), "top_logprobs"
    else:
        k, name = get_field(body, "logprobs", (int,), None), "logprobs"
        if k is None:
            return None
    if not 0 <= k <= MAX_LOGPROBS:
        raise ServeError(400, f"'{name}' must be in [0, {MAX_LOGPROBS}], got {k}", name)
    return k


def _stops(body: dict[str, Any], vocab_size: int | None) -> tuple[list[str], list[int]]:
    """The request's stop strings ('stop': a string or a list of them) and stop_token_ids (in the
    vocabulary when its size is known)."""
    stop = get_field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise ServeError(400, "'stop' must be a string or a list of strings", "stop")
    stop_ids = get_field(body, "stop_token_ids", (list,), [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise ServeError(400, "'stop_token_ids' must be a list of integers", "stop_token_ids")
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in stop_ids):
        bad = [t for t in stop_ids if not 0 <= t < vocab_size][:5]
        raise ServeError(
            400, f"'stop_token_ids' {bad} are outside the vocabulary [0, {vocab_size})", "stop_token_ids"
        )
    return stop, stop_ids


def sampling_params(
    body: dict[str, Any], max_tokens_default: int, chat: bool = False, vocab_size: int | None = None
) -> SamplingParams:
    """SamplingParams from an OpenAI request body (top_k, ignore_eos and stop_token_ids are extensions)."""
    for name, ok in _UNSUPPORTED.items():
        if body.get(name) not in ok:
            raise ServeError(400, f"'{name}' is not supported by this server", name)
    for name in ("presence_penalty", "frequency_penalty"):
        if get_field(body, name, (int, float), 0) != 0:
            raise ServeError(400, f"'{name}' is not supported (only 0)", name)
    max_tokens = get_field(body, "max_completion_tokens", (int,), None)
    max_tokens = get_field(
        body, "max_tokens", (int,), max_tokens if max_tokens is not None else max_tokens_default
    )
    stop, stop_ids = _stops(body, vocab_size)
    values = {
        "max_tokens": max_tokens,
        "temperature": float(get_field(body, "temperature", (int, float), 1.0)),
        "top_p": float(get_field(body, "top_p", (int, float), 1.0)),
        "top_k": get_field(body, "top_k", (int,), 0),
        "seed": get_field(body, "seed", (int,), None),
        "stop": tuple(stop),
        "stop_token_ids": tuple(stop_ids),
        "ignore_eos": get_field(body, "ignore_eos", (bool,), False),
        "logprobs": _logprobs(body, chat),
    }
    if not chat and get_field(body, "echo", (bool,), False):  # the prompt's tokens are returned too, scored
        values["prompt_logprobs"] = values["logprobs"]
    try:
        return SamplingParams(**values)
    except ValueError as e:  # "SamplingParams.<field> must ...": name the request field
        name = str(e).split(" ", 1)[0].removeprefix("SamplingParams.")
        raise ServeError(400, str(e).replace("SamplingParams.", ""), name if name in values else None) from e


# ---------------------------------------------------------------- response pieces


def completion_logprobs(
    tok: Any, lps: list[TokenLogprob], offset: int = 0, prompt: list[TokenLogprob | None] | None = None,
    first_prompt_id: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset. With `prompt` (echo)
    the prompt's tokens come first; the very first has no log-probability (null)."""
    entries: list[tuple[int, TokenLogprob | None]] = []
    if prompt is not None:
        entries = [(first_prompt_id if e is None else e.token_id, e) for e in prompt]
    entries += [(lp.token_id, lp) for lp in lps]
    tokens = [tok.decode([i], skip_special_tokens=False) for i, _ in entries]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else e.logprob for _, e in entries],
        "top_logprobs": [
            None if e is None else {tok.decode([i], skip_special_tokens=False): v for i, v in e.top}
            for _, e in entries
        ],
        "text_offset": offsets,
    }


def chat_logprobs(tok: Any, lps: list[TokenLogprob]) -> dict[str, Any]:
    """The chat shape: content = [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]."""

    def entry(i: int, v: float) -> dict[str, Any]:
        text = tok.decode([i], skip_special_tokens=False)
        return {"token": text, "logprob": v, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(i, v) for i, v in lp.top]} for lp in lps
        ]
    }


def finish_reason(out: RequestOutput) -> str | None:
    if not out.finished:
        return None
    reasons: dict[FinishReason | None, str] = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}
    return reasons.get(out.finish_reason, "stop")


def usage_block(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
