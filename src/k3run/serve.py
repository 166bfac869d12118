"""An OpenAI-compatible HTTP server over one LLMEngine: `/v1/models`, `/v1/completions` and
`/v1/chat/completions`, with server-sent-event streaming (`"stream": true`).

Every client shares the engine, so concurrent requests are batched by its scheduler (continuous batching):
a background thread takes new requests and aborts from thread-safe queues, steps the engine while anything is
unfinished and hands each output to its request's asyncio queue. HTTP handlers never wait on a model step.

Errors follow OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad request (the
field is named), 404 for an unknown model name, 500 if a model step fails (every request then in flight gets
it). A client that disconnects mid-stream has its request aborted and its cache slot freed.

Needs the `serve` extra (fastapi, uvicorn): `k3run serve [MODEL] --port 8000`.
"""

import asyncio
import contextlib
import dataclasses
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

from k3run.engine import LLMEngine, SamplingParams
from k3run.engine.sequence import MAX_LOGPROBS, FinishReason, RequestOutput, TokenLogprob

log = logging.getLogger(__name__)
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


@dataclass
class _Request:
    key: int
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    rid: int | None = None  # the engine's id, once the engine thread has added it


@dataclass
class _Plan:
    reqs: list[_Request]
    echoes: list[str | None]  # per choice: the prompt text to put before the completion (echo), or None
    prompt_tokens: int  # each prompt counted once
    stream: bool
    include_usage: bool
    score_only: bool  # echo with max_tokens 0: the one generated token is dropped


Command = tuple[list[tuple[int, list[int], SamplingParams]], list[int], bool]  # (adds, aborts, stop)


def apply_command(engine: LLMEngine, rids: dict[int, int], cmd: Command) -> dict[int, ValueError]:
    """Apply one step's new requests and aborts to `engine` (the same on every tensor-parallel rank, so all
    ranks keep identical schedules); `rids` maps request keys to engine ids. Returns the adds that failed."""
    adds, aborts, _ = cmd
    errors = {}
    for key, ids, params in adds:
        try:
            rids[key] = engine.add_request(ids, params)
        except ValueError as e:
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
        self._thread = threading.Thread(target=self._run, name="k3run-engine", daemon=True)
        self._thread.start()

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
            except Exception:  # the engine thread must outlive any one request's failure
                log.exception("k3run serve: engine loop error")

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
                self._deliver(req, ServeError(400, str(errors[req.key]), "prompt"))
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
        try:
            outs = self.engine.step()
        except Exception as e:  # a failed step fails every request in flight; the server stays up
            log.exception("model step failed")
            for req in list(self._live.values()):
                self._deliver(req, ServeError(500, f"model step failed: {e}", kind="server_error"))
                self._aborts.append(req.key)  # through the next command, so every rank drops it
            return False
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


_UNSUPPORTED = {"best_of": (None, 1), "suffix": (None, "")}


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


def sampling_params(body: dict[str, Any], max_tokens_default: int, chat: bool = False) -> SamplingParams:
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


class OpenAIServer:
    """The request handling, independent of the web framework (`build_app` wires it to FastAPI)."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.max_model_len
        self.async_engine = AsyncEngine(engine, tensor_parallel=engine.config.tp_size > 1)
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
        """One or several prompts, each a string or a list of token ids."""
        prompt = body.get("prompt")

        def is_ids(p: Any) -> bool:
            return (
                isinstance(p, list)
                and bool(p)
                and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
            )

        if isinstance(prompt, str):
            return [self.tokenizer.encode(prompt)]
        if is_ids(prompt):
            return [list(prompt)]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
            return [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]
        raise ServeError(
            400, "'prompt' must be a string, a list of token ids, or a non-empty list of either", "prompt"
        )

    def _chat_ids(self, body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ServeError(400, "'messages' must be a non-empty list", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ServeError(
                    400, f"messages[{i}] must be an object with a string 'role'", f"messages[{i}].role"
                )
            content = m.get("content")
            if isinstance(content, list):  # text parts only
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                    raise ServeError(
                        400, f"messages[{i}].content: only text parts are supported", f"messages[{i}].content"
                    )
                m = {**m, "content": "".join(str(p.get("text", "")) for p in content)}
                messages[i] = m
            elif not isinstance(content, str):
                raise ServeError(400, f"messages[{i}].content must be a string", f"messages[{i}].content")
        if self.tokenizer.chat_template is None:
            raise ServeError(
                400, f"model '{self.model_name}' has no chat template: use /v1/completions", "messages"
            )
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        # the template writes its own special tokens (BOS included)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _start(self, body: dict[str, Any], chat: bool) -> "_Plan":
        """Submit every (prompt, choice) pair, in choice-index order."""
        if not isinstance(body, dict):
            raise ServeError(400, "the request body must be a JSON object")
        self._check_model(body)
        if chat and body.get("echo") is not None:
            raise ServeError(400, "'echo' is a /v1/completions field", "echo")
        prompts = [self._chat_ids(body)] if chat else self._prompt_ids(body)
        n = _get(body, "n", (int,), 1)
        if not 1 <= n <= MAX_CHOICES:
            raise ServeError(400, f"'n' must be in [1, {MAX_CHOICES}], got {n}", "n")
        if len(prompts) * n > MAX_CHOICES:
            raise ServeError(400, f"{len(prompts)} prompts x n={n} is over {MAX_CHOICES} choices", "n")
        for ids in prompts:
            if len(ids) >= self.max_model_len:
                raise ServeError(
                    400,
                    f"the prompt has {len(ids)} tokens; this server's max_model_len is {self.max_model_len}",
                    "messages" if chat else "prompt",
                )
        stream = _get(body, "stream", (bool,), False)
        echo = not chat and _get(body, "echo", (bool,), False)
        if echo and stream:
            raise ServeError(400, "'echo' with 'stream' is not supported", "echo")
        # scoring a prompt: max_tokens 0 with echo (one token is generated and dropped)
        score_only = echo and body.get("max_tokens") == 0
        params = sampling_params(
            body | {"max_tokens": 1} if score_only else body,
            (self.max_model_len - len(prompts[0])) if chat else 16,
            chat,
        )
        options = _get(body, "stream_options", (dict,), {})
        include_usage = _get(options, "include_usage", (bool,), False)
        raw = body.get("prompt")
        texts = []
        if echo:  # the prompt as given (a string), or decoded (token ids)
            items = [raw] if isinstance(raw, str) or (raw and not isinstance(raw[0], (str, list))) else raw
            texts = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in items]
        reqs, echoes = [], []
        for p, ids in enumerate(prompts):
            for j in range(n):
                # seeded choices of one prompt get distinct seeds, or they would all be the same sample
                pj = (
                    params
                    if params.seed is None or j == 0
                    else dataclasses.replace(params, seed=params.seed + j)
                )
                reqs.append(self.async_engine.submit(ids, pj))
                echoes.append(texts[p] if echo else None)
        return _Plan(reqs, echoes, sum(len(ids) for ids in prompts), stream, include_usage, score_only)

    async def _outputs(self, req: _Request) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    raise item
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
        plan = self._start(body, chat)
        reqs, prompt_tokens = plan.reqs, plan.prompt_tokens
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        merged = self._merged(reqs)
        if plan.stream:
            try:  # errors before the first token (a bad prompt, a failed step) are plain HTTP errors
                first = await merged.__anext__()
            except BaseException:
                await merged.aclose()
                raise
            return None, self._sse(rid, chat, first, merged, prompt_tokens if plan.include_usage else None)
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
                msg = {"role": "assistant", "content": text}
                choices.append(
                    {"index": i, "message": msg, "logprobs": lps, "finish_reason": _finish_reason(out)}
                )
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

    async def _sse(
        self,
        rid: str,
        chat: bool,
        first: tuple[int, RequestOutput],
        rest: AsyncIterator[tuple[int, RequestOutput]],
        prompt_tokens: int | None,
    ) -> AsyncIterator[str]:
        """Chunks as the choices produce text; with prompt_tokens (stream_options.include_usage) a last chunk
        with no choices carries the usage, as OpenAI sends it."""
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        started: set[int] = set()
        completion_tokens = {}
        sent_lps: dict[int, int] = {}  # per choice: tokens whose logprobs were already sent
        lp_offset: dict[int, int] = {}  # per choice: characters of those tokens (completions' text_offset)

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
            if chat:
                delta: dict[str, Any] = {} if i in started else {"role": "assistant"}
                if out.delta:
                    delta["content"] = out.delta
                choice["delta"] = delta
            else:
                choice["text"] = out.delta
            choice |= {"logprobs": lps, "finish_reason": _finish_reason(out)}
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


def build_app(server: OpenAIServer) -> Any:
    """The FastAPI application around `server`."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        server.async_engine.shutdown()

    app = FastAPI(title="k3run", version="1", lifespan=lifespan)

    @app.exception_handler(ServeError)
    async def _serve_error(_: Request, e: ServeError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    async def _body(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ServeError(400, f"the request body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise ServeError(400, "the request body must be a JSON object")
        return body

    async def _respond(request: Request, chat: bool) -> Any:
        result, stream = await server.complete(await _body(request), chat)
        if stream is not None:
            return StreamingResponse(stream, media_type="text/event-stream")
        return JSONResponse(result)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(server.models())

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await _respond(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await _respond(request, chat=True)

    return app
