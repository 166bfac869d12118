"""An OpenAI-compatible HTTP server over one LLMEngine: `/v1/models`, `/v1/completions` and
`/v1/chat/completions`, with server-sent-event streaming (`"stream": true`), `/health` and `/metrics`.

Every client shares the engine, so concurrent requests are batched by its scheduler (continuous batching):
a background thread takes new requests and aborts from thread-safe queues, steps the engine while anything is
unfinished and hands each output to its request's asyncio queue. HTTP handlers never wait on a model step,
and request bodies are parsed and tokenized on worker threads, so one large body does not stall the others.

Errors follow OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad request (the
field is named: a field the server does not implement, or does not know, is refused rather than ignored),
404 for an unknown model name, 413 for a body over the size limit, 500 if adding a request or a model step
fails (a failed add fails that request; a failed step every request then in flight; the loop goes on). A
client that disconnects, streaming or not, has its request aborted and its cache slot freed. `/health`
answers 503 when the engine thread has died or one step has run longer than `stall_s`.

Needs the `serve` extra (fastapi, uvicorn, prometheus-client): `k3run serve [MODEL] --port 8000`.
"""

import asyncio
import contextlib
import dataclasses
import hmac
import itertools
import json
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from k3run import chat_xtml
from k3run.chat_output import (
    ARG_BEGIN,
    CALL_BEGIN,
    SECTION_BEGIN,
    THINK_BEGIN,
    ParseOptions,
    StopCut,
    StreamParser,
    calls_structure,
    cut_at_stop,
    incremental_decode,
    parse_output,
)
from k3run.chat_xtml import XtmlError, XtmlOptions, XtmlStreamParser
from k3run.engine import LLMEngine, SamplingParams
from k3run.engine.sequence import MAX_LOGPROBS, FinishReason, RequestOutput, TokenLogprob

log = logging.getLogger(__name__)
MAX_CHOICES = 64  # prompts x n per request
DEFAULT_MAX_BODY_BYTES = 4 << 20  # a 128K-token prompt is ~0.5 MB as text, ~0.8 MB as a JSON id list
DEFAULT_STALL_S = 120.0  # far above any one step's time, even a long prefill chunk on a CPU


class ServeError(Exception):
    """An error for the client: HTTP status, OpenAI error type, the offending field."""

    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


@dataclass
class _Request:
    key: int
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    rid: int | None = None  # the engine's id, once the engine thread has added it


@dataclass
class _Parsed:
    """A validated, tokenized request, before it reaches the engine."""

    prompts: list[list[int]]
    params: SamplingParams
    n: int
    echoes: list[str] | None  # per prompt: its text for echo, or None without echo
    stream: bool
    include_usage: bool
    score_only: bool
    parse: ParseOptions | XtmlOptions | None = None  # chat: reasoning / tool calls to split out of the output


@dataclass
class _ChatPrompt:
    """A rendered conversation: its ids, what to split out of the reply (None: plain text), and what the
    reply is held to: a JSON schema or a structure (engine/grammar.py), with the request field it comes
    from; extra stop token ids (the format's end of turn)."""

    ids: list[int]
    parse: ParseOptions | XtmlOptions | None = None
    json_schema: str | None = None
    structure: str | None = None
    constraint_field: str = "response_format"
    stop_ids: tuple[int, ...] = ()


def _stream_parser(opts: ParseOptions | XtmlOptions) -> StreamParser | XtmlStreamParser:
    return XtmlStreamParser(opts) if isinstance(opts, XtmlOptions) else StreamParser(opts)


def _parse_whole(text: str, opts: ParseOptions | XtmlOptions):  # -> ChatOutput
    return chat_xtml.parse_output(text, opts) if isinstance(opts, XtmlOptions) else parse_output(text, opts)


@dataclass
class _Plan:
    reqs: list[_Request]
    echoes: list[str | None]  # per choice: the prompt text to put before the completion (echo), or None
    prompt_tokens: int  # each prompt counted once
    stream: bool
    include_usage: bool
    score_only: bool  # echo with max_tokens 0: the one generated token is dropped
    parse: ParseOptions | XtmlOptions | None = None
    stop: tuple[str, ...] = ()


Command = tuple[list[tuple[int, list[int], SamplingParams]], list[int], bool]  # (adds, aborts, stop)


def apply_command(engine: LLMEngine, rids: dict[int, int], cmd: Command) -> dict[int, Exception]:
    """Apply one step's new requests and aborts to `engine` (the same on every tensor-parallel rank, so all
    ranks keep identical schedules); `rids` maps request keys to engine ids. Returns the adds that failed."""
    adds, aborts, _ = cmd
    errors: dict[int, Exception] = {}
    for key, ids, params in adds:
        try:
            rids[key] = engine.add_request(ids, params)
        except Exception as e:  # whatever one request's add raises concerns that request alone
            if not isinstance(e, ValueError):
                log.exception("adding request %d failed", key)
            errors[key] = e
    for key in aborts:
        rid = rids.pop(key, None)
        if rid is not None:
            engine.abort(rid)
    return errors


def _broadcast(cmd: Command | None) -> Command:
    import torch.distributed as dist

    box = [cmd]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[return-value]


def follow(engine: LLMEngine) -> None:
    """A tensor-parallel rank other than 0: mirror rank 0's requests and steps until it stops."""
    rids: dict[int, int] = {}
    while True:
        cmd = _broadcast(None)
        if cmd[2]:
            return
        apply_command(engine, rids, cmd)
        if engine.has_unfinished():
            finished = {o.request_id for o in engine.step() if o.finished}
            if finished:
                for key in [k for k, r in rids.items() if r in finished]:
                    del rids[key]


class AsyncEngine:
    """Runs `engine` on a background thread; `submit` / `abort` are safe from any thread.

    With `tensor_parallel`, this is rank 0: every iteration broadcasts its new requests and aborts (an empty
    command at least once a second while idle, so the other ranks' collectives never time out) and the
    other ranks run `follow`.
    """

    def __init__(self, engine: LLMEngine, tensor_parallel: bool = False) -> None:
        self.engine = engine
        self.tensor_parallel = tensor_parallel
        self._keys = itertools.count()
        self._new: deque[_Request] = deque()
        self._aborts: deque[int] = deque()
        self._live: dict[int, _Request] = {}  # key -> request, touched by the engine thread only
        self._by_rid: dict[int, _Request] = {}
        self._rids: dict[int, int] = {}  # key -> engine id
        self._wake = threading.Event()
        self._stop = False
        self._step_started: float | None = None  # time.monotonic() of the step running now, if any
        self.metrics: Metrics | None = None
        self._thread = threading.Thread(target=self._run, name="k3run-engine", daemon=True)
        self._thread.start()

    def health(self, stall_s: float) -> str | None:
        """None when the engine thread is alive and no step has run longer than `stall_s`; else why not."""
        if not self._thread.is_alive():
            return "the engine thread has stopped"
        started = self._step_started
        if started is not None and time.monotonic() - started > stall_s:
            return f"one engine step has run for {time.monotonic() - started:.0f} s (limit {stall_s:g} s)"
        return None

    def counts(self) -> tuple[int, int]:
        """(running, waiting) sequences of the engine's scheduler."""
        sched = self.engine.scheduler
        return len(sched.running), len(sched.waiting)

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> _Request:
        req = _Request(next(self._keys), prompt_ids, params, asyncio.get_running_loop())
        self._new.append(req)
        self._wake.set()
        return req

    def abort(self, req: _Request) -> None:
        self._aborts.append(req.key)
        self._wake.set()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _deliver(self, req: _Request, item: RequestOutput | BaseException) -> bool:
        try:
            req.loop.call_soon_threadsafe(req.queue.put_nowait, item)
            return True
        except RuntimeError:  # the request's event loop has closed, and its client with it
            return False

    def _forget(self, req: _Request) -> None:
        self._live.pop(req.key, None)
        self._rids.pop(req.key, None)
        if req.rid is not None:
            self._by_rid.pop(req.rid, None)

    def _run(self) -> None:
        while True:
            try:
                if self._iteration():
                    return
            except Exception as e:  # the engine thread must outlive any one request's failure
                log.exception("k3run serve: engine loop error")
                self._fail_in_flight(f"engine error: {e}")

    def _fail_in_flight(self, message: str) -> None:
        """A 500 to every request the engine holds; each is aborted through the next command, so every
        tensor-parallel rank drops it."""
        for req in list(self._live.values()):
            self._deliver(req, ServeError(500, message, kind="server_error"))
            self._aborts.append(req.key)

    def _iteration(self) -> bool:
        """Take new requests and aborts, then one engine step (or a short wait when idle). True: stopped."""
        adds = [self._new.popleft() for _ in range(len(self._new))]
        aborts = [self._aborts.popleft() for _ in range(len(self._aborts))]
        cmd: Command = ([(r.key, r.prompt_ids, r.params) for r in adds], aborts, self._stop)
        if self.tensor_parallel:
            _broadcast(cmd)
        if self._stop:
            return True
        errors = apply_command(self.engine, self._rids, cmd)
        for req in adds:
            if req.key in errors:
                e = errors[req.key]
                if isinstance(e, ValueError):
                    self._deliver(req, ServeError(400, str(e), "prompt" if "prompt" in str(e) else None))
                else:
                    err = ServeError(500, f"adding the request failed: {e}", kind="server_error")
                    self._deliver(req, err)
                continue
            req.rid = self._rids[req.key]
            self._live[req.key] = req
            self._by_rid[req.rid] = req
        for key in aborts:
            req = self._live.get(key)
            if req is not None:
                self._forget(req)
        if not self.engine.has_unfinished():
            self._wake.wait(timeout=1.0)
            self._wake.clear()
            return False
        self._step_started = time.monotonic()
        try:
            outs = self.engine.step()
        except Exception as e:  # a failed step fails every request in flight; the server stays up
            log.exception("model step failed")
            if self.metrics is not None:
                self.metrics.step_failures.inc()
            self._fail_in_flight(f"model step failed: {e}")
            return False
        finally:
            self._step_started = None
        for out in outs:
            req = self._by_rid.get(out.request_id)
            if req is None:
                continue
            delivered = self._deliver(req, out)
            if out.finished:
                self._forget(req)
            elif not delivered:
                self._aborts.append(req.key)
        return False


# ---------------------------------------------------------------- request parsing (plain dicts, named fields)


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "an integer", float: "a number",
               bool: "a boolean"}  # fmt: skip


def _get(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any) -> Any:
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
_EFFORTS = ("low", "medium", "high")  # for Jinja templates; K3's format has its own (chat_xtml.EFFORTS)


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


def _check_message(i: int, m: Any) -> dict[str, Any]:
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
    if role == "assistant" and m.get("reasoning_content") is not None:
        if not isinstance(m["reasoning_content"], str):
            raise ServeError(400, f"{where}.reasoning_content must be a string", f"{where}.reasoning_content")
    if role == "tool" and not isinstance(m.get("tool_call_id"), str):
        raise ServeError(400, f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
    return _text(i, m, nullable=role == "assistant" and calls is not None)


def _check_tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's tools: [{"type": "function", "function": {"name", "description"?, "parameters"?}}]."""
    tools = _get(body, "tools", (list,), [])
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


def _tool_choice(body: dict[str, Any], tools: list[dict[str, Any]]) -> str | dict[str, Any]:
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


def _response_schema(body: dict[str, Any]) -> str | None:
    """The JSON schema (as text) `response_format` asks for: None for text, {"type": "object"} for any JSON
    object, or the request's schema."""
    fmt = _get(body, "response_format", (dict,), None)
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
        if not _get(body, "logprobs", (bool,), False):
            if body.get("top_logprobs") not in (None, 0):
                raise ServeError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
            return None
        k, name = _get(body, "top_logprobs", (int,), 0), "top_logprobs"
    else:
        k, name = _get(body, "logprobs", (int,), None), "logprobs"
        if k is None:
            return None
    if not 0 <= k <= MAX_LOGPROBS:
        raise ServeError(400, f"'{name}' must be in [0, {MAX_LOGPROBS}], got {k}", name)
    return k


def sampling_params(
    body: dict[str, Any], max_tokens_default: int, chat: bool = False, vocab_size: int | None = None
) -> SamplingParams:
    """SamplingParams from an OpenAI request body (top_k, ignore_eos and stop_token_ids are extensions)."""
    for name, ok in _UNSUPPORTED.items():
        if body.get(name) not in ok:
            raise ServeError(400, f"'{name}' is not supported by this server", name)
    for name in ("presence_penalty", "frequency_penalty"):
        if _get(body, name, (int, float), 0) != 0:
            raise ServeError(400, f"'{name}' is not supported (only 0)", name)
    max_tokens = _get(body, "max_completion_tokens", (int,), None)
    max_tokens = _get(
        body, "max_tokens", (int,), max_tokens if max_tokens is not None else max_tokens_default
    )
    stop = _get(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise ServeError(400, "'stop' must be a string or a list of strings", "stop")
    stop_ids = _get(body, "stop_token_ids", (list,), [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise ServeError(400, "'stop_token_ids' must be a list of integers", "stop_token_ids")
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in stop_ids):
        bad = [t for t in stop_ids if not 0 <= t < vocab_size][:5]
        raise ServeError(
            400, f"'stop_token_ids' {bad} are outside the vocabulary [0, {vocab_size})", "stop_token_ids"
        )
    values = {
        "max_tokens": max_tokens,
        "temperature": float(_get(body, "temperature", (int, float), 1.0)),
        "top_p": float(_get(body, "top_p", (int, float), 1.0)),
        "top_k": _get(body, "top_k", (int,), 0),
        "seed": _get(body, "seed", (int,), None),
        "stop": tuple(stop),
        "stop_token_ids": tuple(stop_ids),
        "ignore_eos": _get(body, "ignore_eos", (bool,), False),
        "logprobs": _logprobs(body, chat),
    }
    if not chat and _get(body, "echo", (bool,), False):  # the prompt's tokens are returned too, scored
        values["prompt_logprobs"] = values["logprobs"]
    try:
        return SamplingParams(**values)
    except ValueError as e:  # "SamplingParams.<field> must ...": name the request field
        name = str(e).split(" ", 1)[0].removeprefix("SamplingParams.")
        raise ServeError(400, str(e).replace("SamplingParams.", ""), name if name in values else None) from e


def _completion_logprobs(
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


def _chat_logprobs(tok: Any, lps: list[TokenLogprob]) -> dict[str, Any]:
    """The chat shape: content = [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]."""

    def entry(i: int, v: float) -> dict[str, Any]:
        text = tok.decode([i], skip_special_tokens=False)
        return {"token": text, "logprob": v, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(i, v) for i, v in lp.top]} for lp in lps
        ]
    }


def _finish_reason(out: RequestOutput) -> str | None:
    if not out.finished:
        return None
    return {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}.get(out.finish_reason, "stop")  # type: ignore[arg-type]


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class Metrics:
    """Prometheus metrics of one server (its own registry, so several servers in one process stay apart)."""

    def __init__(self, async_engine: "AsyncEngine") -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "k3run_requests", "HTTP requests answered, by endpoint and status", ["endpoint", "status"],
            registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter("k3run_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("k3run_generation_tokens", "tokens generated", registry=r)
        self.step_failures = Counter("k3run_engine_step_failures", "engine steps that raised", registry=r)
        latency = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
        self.ttft = Histogram(
            "k3run_time_to_first_token_seconds", "from admission to the first token", buckets=latency,
            registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "k3run_inter_token_latency_seconds", "between a request's successive outputs", buckets=latency,
            registry=r,
        )  # fmt: skip
        running = Gauge("k3run_requests_running", "sequences in the running batch", registry=r)
        waiting = Gauge("k3run_requests_waiting", "sequences queued for admission", registry=r)
        running.set_function(lambda: async_engine.counts()[0])
        waiting.set_function(lambda: async_engine.counts()[1])
        pc = getattr(getattr(async_engine, "engine", None), "prefix_cache", None)
        if pc is not None:  # read at scrape time from the engine thread's counters
            for name, doc, read in (
                ("k3run_prefix_cache_lookups", "admitted prompts long enough to look up", lambda: pc.lookups),
                ("k3run_prefix_cache_hits", "lookups that found a stored prefix", lambda: pc.hits),
                (
                    "k3run_prefix_cache_hit_tokens",
                    "prompt tokens restored instead of computed",
                    lambda: pc.hit_tokens,
                ),
                ("k3run_prefix_cache_bytes", "bytes of stored snapshots", lambda: pc.used_bytes),
            ):
                Gauge(name, doc, registry=r).set_function(read)

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class OpenAIServer:
    """The request handling, independent of the web framework (`build_app` wires it to FastAPI).

    max_body_bytes: the largest request body read (413 above); stall_s: how long one engine step may run
    before /health reports the engine as stalled; api_key: the Bearer key /v1 requires (None: open);
    max_concurrent: completion requests answered at once (429 past it; None: no limit).
    """

    def __init__(
        self,
        engine: LLMEngine,
        model_name: str,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        stall_s: float = DEFAULT_STALL_S,
        api_key: str | None = None,
        max_concurrent: int | None = None,
    ) -> None:
        if api_key is not None and not api_key:
            raise ValueError("api_key: an empty key would let every client in; give a key or none")
        self.engine = engine
        self.model_name = model_name
        self.max_body_bytes = max_body_bytes
        self.stall_s = stall_s
        self.api_key = api_key
        self.max_concurrent = max_concurrent
        self.in_flight = 0  # completion requests admitted and not yet answered (streams until they end)
        self.tokenizer = engine.tokenizer
        # K3's chat format (its tokenizer has the XTML markup tokens): rendered by chat_xtml, not a template
        self.xtml = chat_xtml.is_xtml(self.tokenizer)
        self.max_model_len = engine.config.max_model_len
        self.vocab_size = engine.model.config.vocab_size
        self.async_engine = AsyncEngine(engine, tensor_parallel=engine.config.tp_size > 1)
        self.metrics = Metrics(self.async_engine)
        self.async_engine.metrics = self.metrics
        self.created = int(time.time())

    def models(self) -> dict[str, Any]:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "k3run"}
        return {"object": "list", "data": [card]}

    def _check_model(self, body: dict[str, Any]) -> None:
        name = _get(body, "model", (str,), self.model_name)
        if name != self.model_name:
            raise ServeError(
                404,
                f"model '{name}' does not exist; this server serves '{self.model_name}'",
                "model",
                "not_found_error",
            )

    def _prompt_ids(self, body: dict[str, Any]) -> list[list[int]]:
        """One or several prompts, each a string or a list of token ids in [0, vocab)."""
        prompt = body.get("prompt")

        def is_ids(p: Any) -> bool:
            return (
                isinstance(p, list)
                and bool(p)
                and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
            )

        if isinstance(prompt, str):
            prompts = [self.tokenizer.encode(prompt)]
        elif is_ids(prompt):
            prompts = [list(prompt)]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
            prompts = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]
        else:
            raise ServeError(
                400, "'prompt' must be a string, a list of token ids, or a non-empty list of either", "prompt"
            )
        for ids in prompts:
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ServeError(
                    400, f"'prompt' token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
                    "prompt",
                )  # fmt: skip
        return prompts

    def _chat_ids(self, body: dict[str, Any]) -> _ChatPrompt:
        """The rendered, tokenized conversation, what to split out of the reply and what holds it."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ServeError(400, "'messages' must be a non-empty list", "messages")
        messages = [_check_message(i, m) for i, m in enumerate(messages)]
        tools = _check_tools(body)
        choice = _tool_choice(body, tools)
        parallel = _get(body, "parallel_tool_calls", (bool,), True)
        effort = _get(body, "reasoning_effort", (str,), None)
        if isinstance(choice, dict) or choice == "required":
            if body.get("response_format") not in (None, {"type": "text"}):
                raise ServeError(
                    400, "'response_format' and a forced 'tool_choice' exclude each other", "tool_choice"
                )
        if self.xtml:
            return self._xtml_ids(body, messages, tools, choice, parallel, effort)
        template = self.tokenizer.chat_template
        if template is None:
            raise ServeError(
                400, f"model '{self.model_name}' has no chat template: use /v1/completions", "messages"
            )
        extra: dict[str, Any] = {}
        # fields the model's template does not read would be silently ignored: refuse them instead
        if tools:
            if "tools" not in template:
                raise ServeError(
                    400, f"the chat template of '{self.model_name}' does not render tools", "tools"
                )
            extra["tools"] = tools
        if effort is not None:
            if effort not in _EFFORTS:
                raise ServeError(
                    400, f"'reasoning_effort' must be one of {', '.join(_EFFORTS)}, got {effort!r}",
                    "reasoning_effort",
                )  # fmt: skip
            if "reasoning_effort" not in template:
                raise ServeError(
                    400, f"the chat template of '{self.model_name}' takes no reasoning_effort",
                    "reasoning_effort",
                )  # fmt: skip
            extra["reasoning_effort"] = effort
        for i, m in enumerate(messages):
            if (m["role"] == "tool" or "tool_calls" in m) and "tool" not in template:
                raise ServeError(
                    400, f"the chat template of '{self.model_name}' does not render tool messages",
                    f"messages[{i}]",
                )  # fmt: skip
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)
        names = frozenset(t["function"]["name"] for t in tools)
        if isinstance(choice, dict):  # a forced call: open it in the prompt, hold the reply to its schema
            name = choice["function"]["name"]
            call_id = f"functions.{name}:0"
            text += f"{SECTION_BEGIN}{CALL_BEGIN}{call_id}{ARG_BEGIN}"
            schema = json.dumps(choice["function"].get("parameters") or {"type": "object"})
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            return _ChatPrompt(ids, ParseOptions(forced=(call_id, name)), schema, constraint_field="tools")
        if choice == "required":  # open the tool-calls section, hold the reply to calls of the tools
            text += SECTION_BEGIN
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            opts = ParseOptions(names=names, parallel=parallel, section_open=True)
            structure = calls_structure(self.tokenizer, tools, parallel)
            return _ChatPrompt(ids, opts, structure=structure, constraint_field="tools")
        think_open = text.rstrip().endswith(THINK_BEGIN)
        opts = None
        if (names and choice == "auto") or think_open or THINK_BEGIN in template:
            opts = ParseOptions(think_open=think_open, names=names if choice == "auto" else frozenset(),
                                parallel=parallel)  # fmt: skip
        # the template writes its own special tokens (BOS included)
        return _ChatPrompt(
            self.tokenizer.encode(text, add_special_tokens=False), opts, _response_schema(body)
        )

    def _xtml_ids(
        self, body: dict[str, Any], messages: list[dict[str, Any]], tools: list[dict[str, Any]],
        choice: str | dict[str, Any], parallel: bool, effort: str | None,
    ) -> _ChatPrompt:  # fmt: skip
        """_chat_ids for K3's format (chat_xtml): rendered by k3run, constrained replies as structures."""
        thinking = effort != "none"
        schema_text = _response_schema(body)
        schema = json.loads(schema_text) if schema_text is not None else None
        json_object = schema is not None and body["response_format"].get("type") == "json_object"
        forced = [choice] if isinstance(choice, dict) else tools if choice == "required" else []
        try:
            segments = chat_xtml.render(
                messages, tools, thinking=thinking, effort=effort if thinking else None,
                tool_choice="required" if forced else choice if isinstance(choice, str) else "auto",
                response_schema=None if json_object else schema, json_object=json_object,
            )  # fmt: skip
            ids = chat_xtml.encode(self.tokenizer, segments)
        except XtmlError as e:
            raise ServeError(400, str(e), e.field or "messages") from e
        names = frozenset(t["function"]["name"] for t in tools) if choice != "none" else frozenset()
        single = isinstance(choice, dict)
        opts = XtmlOptions(thinking=thinking, names=names, parallel=parallel and not single)
        structure, field = None, "response_format"
        if forced:
            structure = chat_xtml.reply_structure(
                self.tokenizer, thinking=thinking, tools=forced, parallel=parallel and not single
            )
            field = "tools"
        elif schema is not None:
            structure = chat_xtml.reply_structure(self.tokenizer, thinking=thinking, response_schema=schema)
        end = self.tokenizer.token_to_id(chat_xtml.END_OF_MSG)
        return _ChatPrompt(ids, opts, structure=structure, constraint_field=field, stop_ids=(end,))

    def parse(self, body: dict[str, Any], chat: bool) -> "_Parsed":
        """Validate and tokenize a request body (no engine access: runs on a worker thread)."""
        if not isinstance(body, dict):
            raise ServeError(400, "the request body must be a JSON object")
        self._check_model(body)
        check_fields(body, chat)
        opts, chat_prompt = None, None
        if chat:
            chat_prompt = self._chat_ids(body)
            opts = chat_prompt.parse
            prompts = [chat_prompt.ids]
        else:
            prompts = self._prompt_ids(body)
        n = _get(body, "n", (int,), 1)
        if not 1 <= n <= MAX_CHOICES:
            raise ServeError(400, f"'n' must be in [1, {MAX_CHOICES}], got {n}", "n")
        if len(prompts) * n > MAX_CHOICES:
            raise ServeError(400, f"{len(prompts)} prompts x n={n} is over {MAX_CHOICES} choices", "n")
        longest = max(len(ids) for ids in prompts)
        if longest >= self.max_model_len:
            raise ServeError(
                400,
                f"the prompt has {longest} tokens; this server's max_model_len is {self.max_model_len}",
                "messages" if chat else "prompt",
            )
        stream = _get(body, "stream", (bool,), False)
        echo = not chat and _get(body, "echo", (bool,), False)
        if echo and stream:
            raise ServeError(400, "'echo' with 'stream' is not supported", "echo")
        # scoring a prompt: max_tokens 0 with echo (one token is generated and dropped)
        score_only = echo and body.get("max_tokens") == 0
        room = self.max_model_len - longest
        params = sampling_params(
            body | {"max_tokens": 1} if score_only else body, room if chat else min(16, room), chat,
            self.vocab_size,
        )  # fmt: skip
        if params.max_tokens > room:
            name = "max_completion_tokens" if "max_tokens" not in body else "max_tokens"
            raise ServeError(
                400,
                f"'{name}' is {params.max_tokens}, but the prompt has {longest} tokens and this server's "
                f"max_model_len is {self.max_model_len}: at most {room} can be generated",
                name,
            )
        if chat_prompt is not None:
            cp = chat_prompt
            if cp.json_schema is not None or cp.structure is not None:
                from k3run.engine.grammar import GrammarError

                try:  # compiled here, on the worker thread; the engine finds it in its cache
                    if cp.structure is not None:
                        self.engine.grammars().compile_structure(cp.structure)
                    else:
                        self.engine.grammars().compile(cp.json_schema)  # type: ignore[arg-type]
                except GrammarError as e:
                    raise ServeError(400, f"{cp.constraint_field}: {e}", cp.constraint_field) from e
                params = dataclasses.replace(params, json_schema=cp.json_schema, grammar=cp.structure)
            if cp.stop_ids:
                params = dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids, *cp.stop_ids))
        options = _get(body, "stream_options", (dict,), {})
        for key in options:
            if key != "include_usage":
                raise ServeError(400, f"stream_options.{key} is not supported", f"stream_options.{key}")
        include_usage = _get(options, "include_usage", (bool,), False)
        raw = body.get("prompt")
        texts = []
        if echo:  # the prompt as given (a string), or decoded (token ids)
            items = [raw] if isinstance(raw, str) or (raw and not isinstance(raw[0], (str, list))) else raw
            texts = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in items]
        return _Parsed(prompts, params, n, texts if echo else None, stream, include_usage, score_only, opts)

    def _submit(self, parsed: "_Parsed") -> "_Plan":
        """Submit every (prompt, choice) pair, in choice-index order (on the event loop)."""
        params = parsed.params
        reqs, echoes = [], []
        for p, ids in enumerate(parsed.prompts):
            for j in range(parsed.n):
                # seeded choices of one prompt get distinct seeds, or they would all be the same sample
                pj = (
                    params
                    if params.seed is None or j == 0
                    else dataclasses.replace(params, seed=(params.seed + j) % 2**64)
                )
                reqs.append(self.async_engine.submit(ids, pj))
                echoes.append(parsed.echoes[p] if parsed.echoes is not None else None)
        prompt_tokens = sum(len(ids) for ids in parsed.prompts)
        return _Plan(
            reqs, echoes, prompt_tokens, parsed.stream, parsed.include_usage, parsed.score_only, parsed.parse,
            tuple(params.stop or ()),
        )  # fmt: skip

    async def _outputs(self, req: _Request) -> AsyncIterator[RequestOutput]:
        finished = False
        t_last = time.monotonic()
        n_tokens = 0
        self.metrics.prompt_tokens.inc(len(req.prompt_ids))
        try:
            while not finished:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    raise item
                now = time.monotonic()
                (self.metrics.itl if n_tokens else self.metrics.ttft).observe(now - t_last)
                t_last = now
                self.metrics.generation_tokens.inc(len(item.token_ids) - n_tokens)
                n_tokens = len(item.token_ids)
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.async_engine.abort(req)

    async def _merged(self, reqs: list[_Request]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) from every request as they come; closing it aborts what is unfinished."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, req: _Request) -> None:
            try:
                async for out in self._outputs(req):
                    queue.put_nowait((i, out))
            except Exception as e:  # cancellation (BaseException) passes through: _outputs aborts then
                queue.put_nowait((i, e))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
        done = 0
        try:
            while done < len(tasks):
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                done += item.finished
                yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def complete(
        self, body: dict[str, Any], chat: bool
    ) -> tuple[dict[str, Any] | None, AsyncIterator[str] | None]:
        """(JSON response, None) or (None, server-sent-event stream)."""
        parsed = await asyncio.to_thread(self.parse, body, chat)
        plan = self._submit(parsed)
        reqs, prompt_tokens = plan.reqs, plan.prompt_tokens
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        merged = self._merged(reqs)
        if plan.stream:
            try:  # errors before the first token (a bad prompt, a failed step) are plain HTTP errors
                first = await merged.__anext__()
            except BaseException:
                await merged.aclose()
                raise
            return None, self._sse(
                rid, chat, first, merged, prompt_tokens if plan.include_usage else None, plan
            )
        final: dict[int, RequestOutput] = {}
        async for i, out in merged:
            if out.finished:
                final[i] = out
        choices = []
        completion_tokens = 0
        for i in range(len(reqs)):
            out = final[i]
            gen_lps, text = out.logprobs, out.text
            if plan.score_only:
                gen_lps, text = ([] if gen_lps is not None else None), ""
            else:
                completion_tokens += len(out.token_ids)
            lps = None
            if chat:
                lps = _chat_logprobs(self.tokenizer, gen_lps) if gen_lps is not None else None
                msg, reason = self._message(out, plan)
                choices.append({"index": i, "message": msg, "logprobs": lps, "finish_reason": reason})
                continue
            echo = plan.echoes[i]
            if gen_lps is not None:
                lps = _completion_logprobs(
                    self.tokenizer,
                    gen_lps,
                    prompt=out.prompt_logprobs if echo is not None else None,
                    first_prompt_id=out.prompt_token_ids[0],
                )
            text = (echo or "") + text
            choices.append({"index": i, "text": text, "logprobs": lps, "finish_reason": _finish_reason(out)})
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": _usage(prompt_tokens, completion_tokens),
        }, None

    def _reply_ids(self, out: RequestOutput) -> list[int]:
        """The generated ids without the stop token that ended them (the engine's text leaves it out)."""
        ids = out.token_ids
        stops = set(self.tokenizer.eos_token_ids)
        if out.finished and out.finish_reason is FinishReason.STOP and ids and ids[-1] in stops:
            return ids[:-1]
        return ids

    def _message(self, out: RequestOutput, plan: "_Plan") -> tuple[dict[str, Any], str | None]:
        """A finished choice's assistant message and finish reason: the text, or with plan.parse the
        reasoning, content and tool calls split out of the text decoded with special tokens."""
        reason = _finish_reason(out)
        if plan.parse is None:
            return {"role": "assistant", "content": out.text}, reason
        raw = self.tokenizer.decode(self._reply_ids(out), skip_special_tokens=False)
        co = _parse_whole(cut_at_stop(raw, plan.stop), plan.parse)
        msg: dict[str, Any] = {"role": "assistant", "content": co.content or (None if co.tool_calls else "")}
        if co.reasoning is not None:
            msg["reasoning_content"] = co.reasoning
        if co.tool_calls:
            msg["tool_calls"] = [c.openai() for c in co.tool_calls]
            reason = "tool_calls" if reason == "stop" else reason
        return msg, reason

    async def _sse(
        self,
        rid: str,
        chat: bool,
        first: tuple[int, RequestOutput],
        rest: AsyncIterator[tuple[int, RequestOutput]],
        prompt_tokens: int | None,
        plan: "_Plan | None" = None,
    ) -> AsyncIterator[str]:
        """Chunks as the choices produce text; with prompt_tokens (stream_options.include_usage) a last chunk
        with no choices carries the usage, as OpenAI sends it."""
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        started: set[int] = set()
        completion_tokens = {}
        sent_lps: dict[int, int] = {}  # per choice: tokens whose logprobs were already sent
        lp_offset: dict[int, int] = {}  # per choice: characters of those tokens (completions' text_offset)
        parse = plan.parse if plan is not None and chat else None
        # with parse: per choice the decode offsets of the text with special tokens, its stop-string cut and
        # the parser splitting it into reasoning, content and tool calls
        offsets: dict[int, tuple[int, int]] = {}
        cuts: dict[int, StopCut] = {}
        parsers: dict[int, StreamParser | XtmlStreamParser] = {}

        def parsed_delta(i: int, out: RequestOutput) -> tuple[dict[str, Any], bool]:
            """(delta fields of this output, whether the choice has made tool calls)."""
            ids = self._reply_ids(out)
            prefix, read = offsets.get(i, (0, 0))
            new, prefix, read = incremental_decode(
                self.tokenizer, ids, prefix, read, out.finished, skip_special_tokens=False
            )
            offsets[i] = (prefix, read)
            assert parse is not None and plan is not None
            cut = cuts.setdefault(i, StopCut(plan.stop))
            parser = parsers.setdefault(i, _stream_parser(parse))
            deltas = parser.feed(cut.feed(new, out.finished))
            if out.finished:
                deltas += parser.finish()
            merged: dict[str, Any] = {}
            for d in deltas:
                for key, value in d.items():
                    merged[key] = merged.get(key, [] if key == "tool_calls" else "") + value
            return merged, bool(parser.calls)

        def chunk(i: int, out: RequestOutput) -> str:
            lps = None
            if out.logprobs is not None:
                new = out.logprobs[sent_lps.get(i, 0) :]
                sent_lps[i] = len(out.logprobs)
                if chat:
                    lps = _chat_logprobs(self.tokenizer, new)
                else:
                    lps = _completion_logprobs(self.tokenizer, new, lp_offset.get(i, 0))
                    if new:
                        lp_offset[i] = lps["text_offset"][-1] + len(lps["tokens"][-1])
            choice: dict[str, Any] = {"index": i}
            reason = _finish_reason(out)
            if chat:
                delta: dict[str, Any] = {} if i in started else {"role": "assistant"}
                if parse is not None:
                    fields, called = parsed_delta(i, out)
                    delta |= fields
                    reason = "tool_calls" if called and reason == "stop" else reason
                elif out.delta:
                    delta["content"] = out.delta
                choice["delta"] = delta
            else:
                choice["text"] = out.delta
            choice |= {"logprobs": lps, "finish_reason": reason}
            started.add(i)
            data: dict[str, Any] = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": self.model_name,
                "choices": [choice],
            }
            if out.finished:
                completion_tokens[i] = len(out.token_ids)
            return f"data: {json.dumps(data)}\n\n"

        try:
            yield chunk(*first)
            async for i, out in rest:
                yield chunk(i, out)
            if prompt_tokens is not None:
                usage = _usage(prompt_tokens, sum(completion_tokens.values()))
                tail = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": []}
                yield f"data: {json.dumps(tail | {'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        except ServeError as e:  # a step failed mid-stream: the status line is already sent
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            await rest.aclose()  # type: ignore[attr-defined]


def request_id(given: str | None) -> str:
    """The client's x-request-id when it is short and plain (letters, digits, - _ . :), else a new one: the
    id goes into logs and headers, so nothing else is echoed."""
    if given and len(given) <= 64 and all(c.isascii() and (c.isalnum() or c in "-_.:") for c in given):
        return given
    return f"req-{uuid.uuid4().hex[:16]}"


def authorized(header: str | None, key: str) -> bool:
    """Whether an Authorization header carries `Bearer <key>`; the key is compared in constant time."""
    scheme, _, token = (header or "").partition(" ")
    ok = hmac.compare_digest(token.strip().encode(), key.encode())
    return scheme.lower() == "bearer" and ok


def build_app(server: OpenAIServer) -> Any:
    """The FastAPI application around `server`."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        server.async_engine.shutdown()

    app = FastAPI(title="k3run", version="1", lifespan=lifespan)

    @app.exception_handler(ServeError)
    async def _serve_error(request: Request, e: ServeError) -> JSONResponse:
        server.metrics.requests.labels(request.url.path, str(e.status)).inc()
        rid = _rid(request)
        log.info("request %s: %s %d %s (param %s)", rid, request.url.path, e.status, e.message, e.param)
        headers = {"x-request-id": rid} | ({"WWW-Authenticate": "Bearer"} if e.status == 401 else {})
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    def _rid(request: Request) -> str:
        """This request's id (made once): the client's x-request-id when plain, else a new one."""
        if not hasattr(request.state, "request_id"):
            request.state.request_id = request_id(request.headers.get("x-request-id"))
        return request.state.request_id

    def _guard(request: Request) -> None:
        """With an API key, the /v1 endpoints need `Authorization: Bearer <key>` (compared in constant time;
        /health and /metrics stay open for probes and scrapers). A route check, not an HTTP middleware:
        Starlette's middleware wrapper hides client disconnects from the route, which the abort needs."""
        if server.api_key is not None and not authorized(
            request.headers.get("authorization"), server.api_key
        ):
            log.warning("request %s: %s 401 (missing or wrong API key)", _rid(request), request.url.path)
            raise ServeError(
                401, "missing or wrong API key (Authorization: Bearer <key>)", None, "authentication_error"
            )

    def _ided(request: Request, response: Any) -> Any:
        response.headers["x-request-id"] = _rid(request)
        return response

    async def _body(request: Request) -> dict[str, Any]:
        limit = server.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ServeError(
                413, f"the request body is {int(declared)} bytes; this server's limit is {limit}"
            )
        chunks, size = [], 0
        async for chunk in request.stream():  # a body without a length is counted as it arrives
            size += len(chunk)
            if size > limit:
                raise ServeError(413, f"the request body is over this server's limit of {limit} bytes")
            chunks.append(chunk)
        try:
            body = await asyncio.to_thread(json.loads, b"".join(chunks))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ServeError(400, f"the request body is not valid JSON: {e}") from e
        except RecursionError as e:
            raise ServeError(400, "the request body nests too deeply") from e
        if not isinstance(body, dict):
            raise ServeError(400, "the request body must be a JSON object")
        return body

    async def _until_disconnect(request: Request) -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.25)

    async def _respond(request: Request, chat: bool) -> Any:
        _guard(request)
        limit = server.max_concurrent
        if limit is not None and server.in_flight >= limit:
            raise ServeError(
                429, f"this server is answering {server.in_flight} requests, its limit; retry later", None,
                "rate_limit_error",
            )  # fmt: skip
        server.in_flight += 1
        try:
            response = await _answer(request, chat)
        except BaseException:
            server.in_flight -= 1
            raise
        if isinstance(response, StreamingResponse):  # counted until the stream ends
            inner = response.body_iterator

            async def counted() -> AsyncIterator[Any]:
                try:
                    async for part in inner:
                        yield part
                finally:
                    server.in_flight -= 1

            response.body_iterator = counted()
        else:
            server.in_flight -= 1
        return _ided(request, response)

    async def _answer(request: Request, chat: bool) -> Any:
        body = await _body(request)
        t0 = time.monotonic()
        rid = _rid(request)
        work = asyncio.ensure_future(server.complete(body, chat))
        watch = asyncio.ensure_future(_until_disconnect(request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if not work.done():  # the client left before the answer: cancelling aborts its requests
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            server.metrics.requests.labels(request.url.path, "499").inc()
            log.info(
                "request %s: %s 499 (the client left after %.2f s)",
                rid,
                request.url.path,
                time.monotonic() - t0,
            )
            return Response(status_code=499)
        result, stream = work.result()
        server.metrics.requests.labels(request.url.path, "200").inc()
        if stream is not None:
            log.info("request %s: %s 200 streaming", rid, request.url.path)
            return StreamingResponse(stream, media_type="text/event-stream")
        usage = result["usage"] if result is not None else {}
        log.info(
            "request %s: %s 200 %s, %d prompt + %d generated tokens in %.2f s", rid, request.url.path,
            result["id"] if result else "-", usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0),
            time.monotonic() - t0,
        )  # fmt: skip
        return JSONResponse(result)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        _guard(request)
        return _ided(request, JSONResponse(server.models()))

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        problem = server.async_engine.health(server.stall_s)
        if problem is not None:
            return _ided(request, JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503))
        return _ided(request, JSONResponse({"status": "ok"}))

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return _ided(request, Response(server.metrics.exposition(), media_type=CONTENT_TYPE_LATEST))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await _respond(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await _respond(request, chat=True)

    return app
