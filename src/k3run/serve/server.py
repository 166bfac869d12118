"""`OpenAIServer`: the completion endpoints' handling, independent of the web framework (`app.build_app`
wires it to FastAPI). A parsed request (`requests.RequestParser`, on a worker thread) becomes one engine
request per (prompt, choice) on the `AsyncEngine`; their outputs come back merged as one JSON response or
as server-sent events, with tool calls and reasoning split out of chat replies (`chat_output`,
`chat_xtml`). A request the engine refuses or fails reaches the client as a `ServeError` (400 / 500).
"""

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from k3run import chat_xtml
from k3run.chat_output import (
    ParseOptions,
    StopCut,
    StreamParser,
    cut_at_stop,
    incremental_decode,
    parse_output,
)
from k3run.chat_xtml import XtmlOptions, XtmlStreamParser
from k3run.engine import LLMEngine
from k3run.engine.async_engine import AsyncEngine, AsyncRequest, RequestFailed, RequestRefused
from k3run.engine.sequence import FinishReason, RequestOutput
from k3run.serve.metrics import Metrics
from k3run.serve.parsing import ParsedRequest, RequestParser
from k3run.serve.protocol import ServeError, chat_logprobs, completion_logprobs, finish_reason, usage_block

DEFAULT_MAX_BODY_BYTES = 4 << 20  # a 128K-token prompt is ~0.5 MB as text, ~0.8 MB as a JSON id list
DEFAULT_STALL_S = 120.0  # far above any one step's time, even a long prefill chunk on a CPU


def _stream_parser(opts: ParseOptions | XtmlOptions) -> StreamParser | XtmlStreamParser:
    return XtmlStreamParser(opts) if isinstance(opts, XtmlOptions) else StreamParser(opts)


def _parse_whole(text: str, opts: ParseOptions | XtmlOptions):  # -> ChatOutput
    return chat_xtml.parse_output(text, opts) if isinstance(opts, XtmlOptions) else parse_output(text, opts)


@dataclass
class _Plan:
    reqs: list[AsyncRequest]
    echoes: list[str | None]  # per choice: the prompt text to put before the completion (echo), or None
    prompt_tokens: int  # each prompt counted once
    stream: bool
    include_usage: bool
    score_only: bool  # echo with max_tokens 0: the one generated token is dropped
    parse: ParseOptions | XtmlOptions | None = None
    stop: tuple[str, ...] = ()


def client_error(e: BaseException) -> BaseException:
    """What the client is told about an exception that ended a request on the engine thread: a refused
    request is a 400 (naming `prompt` when the engine's message does), a failed one a 500."""
    if isinstance(e, RequestRefused):
        return ServeError(400, str(e), "prompt" if "prompt" in str(e) else None)
    if isinstance(e, RequestFailed):
        return ServeError(500, str(e), kind="server_error")
    return e


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
        self.max_model_len = engine.config.max_model_len
        self.vocab_size = engine.model.config.vocab_size
        self.parser = RequestParser(
            self.tokenizer, model_name, self.max_model_len, self.vocab_size, engine.grammars
        )
        self.async_engine = AsyncEngine(engine, tensor_parallel=engine.config.tp_size > 1)
        self.metrics = Metrics(self.async_engine)
        self.async_engine.on_step_failure = self.metrics.step_failures.inc
        self.created = int(time.time())

    def models(self) -> dict[str, Any]:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "k3run"}
        return {"object": "list", "data": [card]}

    def _submit(self, parsed: "ParsedRequest") -> "_Plan":
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

    async def _outputs(self, req: AsyncRequest) -> AsyncIterator[RequestOutput]:
        finished = False
        t_last = time.monotonic()
        n_tokens = 0
        self.metrics.prompt_tokens.inc(len(req.prompt_ids))
        try:
            while not finished:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    raise client_error(item)
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

    async def _merged(self, reqs: list[AsyncRequest]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """(choice index, output) from every request as they come; closing it aborts what is unfinished."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, req: AsyncRequest) -> None:
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
        parsed = await asyncio.to_thread(self.parser.parse, body, chat)
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
                lps = chat_logprobs(self.tokenizer, gen_lps) if gen_lps is not None else None
                msg, reason = self._message(out, plan)
                choices.append({"index": i, "message": msg, "logprobs": lps, "finish_reason": reason})
                continue
            echo = plan.echoes[i]
            if gen_lps is not None:
                lps = completion_logprobs(
                    self.tokenizer,
                    gen_lps,
                    prompt=out.prompt_logprobs if echo is not None else None,
                    first_prompt_id=out.prompt_token_ids[0],
                )
            text = (echo or "") + text
            choices.append({"index": i, "text": text, "logprobs": lps, "finish_reason": finish_reason(out)})
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": usage_block(prompt_tokens, completion_tokens),
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
        reason = finish_reason(out)
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

    def _new_logprobs(
        self, i: int, logprobs: list[Any], chat: bool, sent: dict[int, int], offset: dict[int, int]
    ) -> dict[str, Any]:
        """Choice i's log-probabilities not yet streamed, in the chat or the completions form; `sent` counts
        the tokens already sent per choice, `offset` their characters (completions' text_offset)."""
        new = logprobs[sent.get(i, 0) :]
        sent[i] = len(logprobs)
        if chat:
            return chat_logprobs(self.tokenizer, new)
        lps = completion_logprobs(self.tokenizer, new, offset.get(i, 0))
        if new:
            offset[i] = lps["text_offset"][-1] + len(lps["tokens"][-1])
        return lps

    async def _sse(
        self,
        rid: str,
        chat: bool,
        first: tuple[int, RequestOutput],
        rest: AsyncGenerator[tuple[int, RequestOutput], None],
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
            lps = (
                None
                if out.logprobs is None
                else self._new_logprobs(i, out.logprobs, chat, sent_lps, lp_offset)
            )
            choice: dict[str, Any] = {"index": i}
            reason = finish_reason(out)
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
                usage = usage_block(prompt_tokens, sum(completion_tokens.values()))
                tail = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": []}
                yield f"data: {json.dumps(tail | {'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        except ServeError as e:  # a step failed mid-stream: the status line is already sent
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            await rest.aclose()
