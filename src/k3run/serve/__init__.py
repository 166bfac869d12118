"""An OpenAI-compatible HTTP server over one LLMEngine: `/v1/models`, `/v1/completions` and
`/v1/chat/completions`, with server-sent-event streaming (`"stream": true`), `/health` and `/metrics`.

Every client shares the engine, so concurrent requests are batched by its scheduler (continuous batching,
`engine.async_engine.AsyncEngine`): HTTP handlers never wait on a model step, and request bodies are parsed
and tokenized on worker threads, so one large body does not stall the others.

Errors follow OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad request (the
field is named: a field the server does not implement, or does not know, is refused rather than ignored),
404 for an unknown model name, 413 for a body over the size limit, 500 if adding a request or a model step
fails (a failed add fails that request; a failed step every request then in flight; the loop goes on). A
client that disconnects, streaming or not, has its request aborted and its cache slot freed. `/health`
answers 503 when the engine thread has died or one step has run longer than `stall_s`.

Modules: `protocol` (field checks, sampling parameters, response pieces), `parsing` (a body validated
and tokenized), `server` (`OpenAIServer`: requests to the engine, outputs to responses and SSE), `metrics`,
`app` (`build_app`: FastAPI). Needs the `serve` extra (fastapi, uvicorn, prometheus-client):
`k3run serve [MODEL] --port 8000`.
"""

from k3run.engine.async_engine import AsyncEngine, AsyncRequest, apply_command, follow
from k3run.serve.app import authorized, build_app, request_id
from k3run.serve.metrics import Metrics
from k3run.serve.protocol import ServeError, check_fields, sampling_params
from k3run.serve.server import DEFAULT_MAX_BODY_BYTES, DEFAULT_STALL_S, OpenAIServer

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_STALL_S",
    "AsyncEngine",
    "AsyncRequest",
    "Metrics",
    "OpenAIServer",
    "ServeError",
    "apply_command",
    "authorized",
    "build_app",
    "check_fields",
    "follow",
    "sampling_params",
    "request_id",
]
