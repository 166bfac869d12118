"""`build_app`: the FastAPI application around an `OpenAIServer`: bounded bodies (413), the API key
(401), the concurrency limit (429), an abort when the client disconnects, `x-request-id` on every response,
/health (503 when the engine thread has stopped or one step has stalled) and /metrics."""

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from k3run.serve.protocol import ServeError
from k3run.serve.server import OpenAIServer

log = logging.getLogger(__name__)


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
    """The FastAPI application around `server` (the routes; the work is in the module's helpers)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

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

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        _guard(server, request)
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
        return await _respond(server, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await _respond(server, request, chat=True)

    return app


def _rid(request: Any) -> str:
    """This request's id (made once): the client's x-request-id when plain, else a new one."""
    if not hasattr(request.state, "request_id"):
        request.state.request_id = request_id(request.headers.get("x-request-id"))
    return request.state.request_id


def _guard(server: OpenAIServer, request: Any) -> None:
    """With an API key, the /v1 endpoints need `Authorization: Bearer <key>` (compared in constant time;
    /health and /metrics stay open for probes and scrapers). A route check, not an HTTP middleware:
    Starlette's middleware wrapper hides client disconnects from the route, which the abort needs."""
    if server.api_key is not None and not authorized(request.headers.get("authorization"), server.api_key):
        log.warning("request %s: %s 401 (missing or wrong API key)", _rid(request), request.url.path)
        raise ServeError(
            401, "missing or wrong API key (Authorization: Bearer <key>)", None, "authentication_error"
        )


def _ided(request: Any, response: Any) -> Any:
    response.headers["x-request-id"] = _rid(request)
    return response


async def _body(server: OpenAIServer, request: Any) -> dict[str, Any]:
    """The request's JSON object, its size bounded by the server's limit (413), parsed off the event loop."""
    limit = server.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ServeError(413, f"the request body is {int(declared)} bytes; this server's limit is {limit}")
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


async def _until_disconnect(request: Any) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)


async def _respond(server: OpenAIServer, request: Any, chat: bool) -> Any:
    """A completion route: the API key, the concurrency limit (429; a stream counts until it ends), the
    answer with this request's id."""
    from fastapi.responses import StreamingResponse

    _guard(server, request)
    limit = server.max_concurrent
    if limit is not None and server.in_flight >= limit:
        raise ServeError(
            429, f"this server is answering {server.in_flight} requests, its limit; retry later", None,
            "rate_limit_error",
        )  # fmt: skip
    server.in_flight += 1
    try:
        response = await _answer(server, request, chat)
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


async def _answer(server: OpenAIServer, request: Any, chat: bool) -> Any:
    """The completion, abandoned (499, its engine requests aborted) when the client disconnects first."""
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    body = await _body(server, request)
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
            "request %s: %s 499 (the client left after %.2f s)", rid, request.url.path, time.monotonic() - t0
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
