"""The server against hostile or careless clients: bad token ids and fields, failing adds and steps, stalls,
disconnects without streaming, oversized bodies, SIGTERM. A real uvicorn server on a loopback port where the
HTTP connection itself matters (disconnects, concurrency), FastAPI's TestClient elsewhere."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")

import httpx  # noqa: E402
import uvicorn  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from k3run.cli import default_model_dir, main  # noqa: E402
from k3run.engine import EngineConfig, LLMEngine  # noqa: E402
from k3run.serve import OpenAIServer, build_app  # noqa: E402
from k3run.tokenizer import load_tokenizer  # noqa: E402

MODEL_DIR = default_model_dir()
pytestmark = pytest.mark.skipif(MODEL_DIR is None, reason="no bundled model")
CONFIG = EngineConfig(max_num_seqs=4, max_model_len=96, max_num_batched_tokens=128)
GREEDY = {"prompt": "def ", "max_tokens": 6, "temperature": 0}


@pytest.fixture
def server(model):
    srv = OpenAIServer(LLMEngine(model, load_tokenizer(MODEL_DIR), CONFIG), "k3", max_body_bytes=4096)
    yield srv
    srv.async_engine.shutdown()


@pytest.fixture
def client(server):
    with TestClient(build_app(server)) as c:
        yield c


@contextlib.contextmanager
def live(server: OpenAIServer) -> Iterator[str]:
    """`server` behind a real uvicorn on a free loopback port, in a thread; yields its base URL."""
    cfg = uvicorn.Config(build_app(server), host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    srv = uvicorn.Server(cfg)
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.time() + 20
    while not (srv.started and srv.servers) and time.time() < deadline:
        time.sleep(0.02)
    assert srv.started, "uvicorn did not start"
    port = srv.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        t.join(timeout=10)


def _error(r: httpx.Response) -> tuple[int, str | None, str]:
    err = r.json()["error"]
    return r.status_code, err["param"], err["message"]


def test_token_ids_outside_the_vocabulary_are_a_400_and_the_engine_goes_on(client, server):
    vocab = server.vocab_size
    for prompt in ([-1], [vocab], [[5, 6], [1, 10**30]]):
        status, param, message = _error(
            client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
        )
        assert (status, param) == (400, "prompt") and f"outside the vocabulary [0, {vocab})" in message
    r = client.post("/v1/completions", json=GREEDY | {"stop_token_ids": [-3]})
    assert _error(r)[:2] == (400, "stop_token_ids")
    ok = client.post("/v1/completions", json=GREEDY)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 6


def test_a_failing_add_fails_that_request_alone(client, server):
    """Any exception from one request's add (not only a ValueError) answers that request with a 500 while
    the request next to it, in the same engine iteration, completes."""
    engine = server.engine
    add = engine.add_request

    def add_or_overflow(ids, params):
        if len(ids) == 3:
            raise OverflowError("number too small to fit in target type")
        return add(ids, params)

    engine.add_request = add_or_overflow
    results: dict[str, httpx.Response] = {}

    def post(name: str, prompt: list[int]) -> None:
        results[name] = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})

    threads = [threading.Thread(target=post, args=a) for a in (("bad", [1, 2, 3]), ("good", [1, 2, 3, 4]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert (
        results["bad"].status_code == 500 and "number too small" in results["bad"].json()["error"]["message"]
    )
    assert results["good"].status_code == 200
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("/v1/completions", GREEDY | {"tools": []}, "tools", "'tools' is a /v1/chat/completions field"),
        ("/v1/completions", GREEDY | {"response_format": {"type": "json_object"}}, "response_format", ""),
        ("/v1/completions", GREEDY | {"temprature": 0}, "temprature", "unknown field 'temprature'"),
        ("/v1/completions", GREEDY | {"messages": []}, "messages", "a /v1/chat/completions field"),
        ("/v1/completions", GREEDY | {"seed": 2**80}, "seed", "seed must be in [0, 2**64)"),
        ("/v1/completions", GREEDY | {"max_tokens": 500}, "max_tokens", "at most 94 can be generated"),
        ("/v1/completions", GREEDY | {"logit_bias": {"5": 10}}, "logit_bias", "not supported"),
        ("/v1/completions", GREEDY | {"stream_options": {"x": 1}}, "stream_options.x", "not supported"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "wizard", "content": "hi"}]},
            "messages[0].role",
            "must be one of system, user, assistant, tool, got 'wizard'",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi", "name": "x"}]},
            "messages[0].name",
            "not supported",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**6},
            "max_completion_tokens",
            "max_model_len is 96",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo", ""),
    ],
)
def test_fields_not_implemented_or_out_of_range_are_refused_by_name(
    client, server, path, body, param, message
):
    if path.endswith("chat/completions") and server.tokenizer.chat_template is None:
        server.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    status, got_param, got = _error(client.post(path, json=body))
    assert (status, got_param) == (400, param) and message in got


def test_oversized_bodies_get_413_with_or_without_a_length(client):
    big = {"prompt": "x" * 5000, "max_tokens": 1}
    r = client.post("/v1/completions", json=big)
    assert r.status_code == 413 and "limit is 4096" in r.json()["error"]["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "over this server's limit of 4096" in r.json()["error"]["message"]
    assert client.post("/v1/completions", content=b"[" * 3000).status_code == 400  # nested, under the limit


def test_tokenizing_runs_off_the_event_loop(server):
    """A slow tokenization (a large prompt) does not hold other clients: /health answers meanwhile."""
    encode = server.tokenizer.encode
    gate = threading.Event()

    def slow_encode(text, *a, **k):
        if text == "slow":
            gate.wait(timeout=20)
        return encode(text, *a, **k)

    server.tokenizer.encode = slow_encode
    try:
        with live(server) as url:
            slow = threading.Thread(
                target=httpx.post,
                args=(f"{url}/v1/completions",),
                kwargs={"json": {"prompt": "slow"}, "timeout": 60},
            )
            slow.start()
            time.sleep(0.3)
            t0 = time.perf_counter()
            assert httpx.get(f"{url}/health", timeout=5).json() == {"status": "ok"}
            assert time.perf_counter() - t0 < 2.0
            gate.set()
            slow.join(timeout=30)
    finally:
        server.tokenizer.encode = encode
        gate.set()


def test_a_non_streaming_client_that_leaves_is_aborted(server):
    engine = server.engine
    step = engine.step

    def slow_step():  # ~90 tokens would take ~4.5 s
        time.sleep(0.05)
        return step()

    engine.step = slow_step
    with live(server) as url:
        port = int(url.rsplit(":", 1)[1])
        body = json.dumps({"prompt": "def ", "max_tokens": 90, "ignore_eos": True}).encode()
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.time() + 5
        while not engine.has_unfinished() and time.time() < deadline:
            time.sleep(0.01)
        assert engine.has_unfinished()
        sock.close()
        t0 = time.time()
        while engine.has_unfinished() and time.time() - t0 < 3:
            time.sleep(0.02)
        assert not engine.has_unfinished(), "the abandoned request is still running"
        assert time.time() - t0 < 2.0
        # the handler counts its 499 after the engine dropped the sequence (another thread): poll briefly
        want = 'k3run_requests_total{endpoint="/v1/completions",status="499"} 1.0'
        deadline = time.time() + 3
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        while want not in metrics and time.time() < deadline:
            time.sleep(0.05)
            metrics = httpx.get(f"{url}/metrics", timeout=5).text
        assert want in metrics


def test_health_reports_a_stalled_or_dead_engine(server, client):
    server.stall_s = 0.2
    engine = server.engine
    step = engine.step
    release = threading.Event()

    def stuck_step():
        release.wait(timeout=20)
        return step()

    engine.step = stuck_step
    t = threading.Thread(target=client.post, args=("/v1/completions",), kwargs={"json": GREEDY})
    t.start()
    time.sleep(0.5)
    r = client.get("/health")
    assert r.status_code == 503 and "one engine step has run for" in r.json()["reason"]
    release.set()
    t.join(timeout=30)
    engine.step = step
    assert client.get("/health").json() == {"status": "ok"}
    server.async_engine.shutdown()
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["reason"] == "the engine thread has stopped"


def test_metrics_count_requests_and_tokens(client):
    client.post("/v1/completions", json=GREEDY)
    client.post("/v1/completions", json=GREEDY | {"n": 0})
    text = client.get("/metrics").text
    assert 'k3run_requests_total{endpoint="/v1/completions",status="200"} 1.0' in text
    assert 'k3run_requests_total{endpoint="/v1/completions",status="400"} 1.0' in text
    assert "k3run_generation_tokens_total 6.0" in text
    assert "k3run_time_to_first_token_seconds_count 1.0" in text
    assert "k3run_inter_token_latency_seconds_count 5.0" in text
    assert "k3run_requests_running 0.0" in text and "k3run_requests_waiting 0.0" in text


def test_generate_refuses_max_tokens_over_the_model_length(capsys):
    rc = main(["generate", "--prompt", "def ", "--max-tokens", "5000", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "--max-tokens 5000 with a" in err[-1] and "--max-model-len 1024" in err[-1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_sigterm_drains_and_stops_within_the_drain_timeout(tmp_path: Path):
    """`k3run serve` in its own process: a request in flight when SIGTERM arrives still completes, and the
    process exits within --drain-timeout (and a margin for the engine thread's stop)."""
    from k3run.kernels import cpu_simd

    cpu_simd.available()  # build the CPU extension here (cached on disk), not inside the timed request
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    cmd = [sys.executable, "-m", "k3run.cli", "--quiet", "serve", "--port", str(port), "--device", "cpu"]
    cmd += ["--eager"]  # no compiled decode steps: minutes of compiling are not what this test is about
    proc = subprocess.Popen(cmd + ["--drain-timeout", "20"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while time.time() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.2)
        result: dict[str, httpx.Response] = {}
        req = {"prompt": "def ", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
        t = threading.Thread(
            target=lambda: result.setdefault("r", httpx.post(f"{url}/v1/completions", json=req, timeout=60))
        )
        t.start()
        time.sleep(0.3)
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=40)
        t.join(timeout=10)
        # uvicorn re-raises the signal once it has shut down, so the exit status says SIGTERM
        assert rc in (0, -signal.SIGTERM) and time.time() - t0 < 25
        assert result["r"].status_code == 200 and result["r"].json()["usage"]["completion_tokens"] == 200
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_api_key_guards_the_v1_endpoints(model, caplog):
    """With a key, /v1 needs `Authorization: Bearer <key>` (401 in OpenAI's error shape otherwise, logged
    with the request id); /health and /metrics stay open; every response carries x-request-id (the
    client's when it is plain, a new one when it is not)."""
    from k3run.serve import authorized

    srv = OpenAIServer(LLMEngine(model, load_tokenizer(MODEL_DIR), CONFIG), "k3", api_key="s3cret")
    try:
        with TestClient(build_app(srv)) as c, caplog.at_level("WARNING", logger="k3run.serve"):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                            {"Authorization": "Basic s3cret"}):  # fmt: skip
                r = c.post("/v1/completions", json=GREEDY, headers=headers | {"x-request-id": "abc-1"})
                assert r.status_code == 401, (headers, r.text)
                assert (
                    r.json()["error"]["type"] == "authentication_error"
                    and r.headers["x-request-id"] == "abc-1"
                )
            assert "request abc-1: /v1/completions 401" in caplog.text
            assert c.get("/v1/models").status_code == 401
            ok = c.post("/v1/completions", json=GREEDY, headers={"Authorization": "Bearer s3cret"})
            assert ok.status_code == 200 and ok.headers["x-request-id"].startswith("req-")
            bad_id = c.get("/health", headers={"x-request-id": "a b\n<script>"})
            assert bad_id.status_code == 200 and bad_id.headers["x-request-id"].startswith("req-")
            assert c.get("/metrics").status_code == 200
    finally:
        srv.async_engine.shutdown()
    assert authorized("Bearer s3cret", "s3cret") and authorized("bearer  s3cret ", "s3cret")
    assert not authorized("Bearer s3cre", "s3cret") and not authorized(None, "s3cret")
    with pytest.raises(ValueError, match="empty key"):
        OpenAIServer(LLMEngine(model, load_tokenizer(MODEL_DIR), CONFIG), "k3", api_key="")


def test_requests_over_the_concurrency_limit_get_429(model):
    """--max-concurrent-requests 1: while one streamed request is open the next gets 429 naming the limit;
    once the stream has ended the next is admitted (streams count until they end)."""
    srv = OpenAIServer(LLMEngine(model, load_tokenizer(MODEL_DIR), CONFIG), "k3", max_concurrent=1)
    try:
        with TestClient(build_app(srv)) as c:
            body = GREEDY | {"max_tokens": 20, "stream": True, "ignore_eos": True}
            with c.stream("POST", "/v1/completions", json=body) as first:
                assert first.status_code == 200
                busy = c.post("/v1/completions", json=GREEDY)
                assert busy.status_code == 429 and busy.json()["error"]["type"] == "rate_limit_error"
                lines = [ln for ln in first.iter_lines() if ln]
            assert lines[-1] == "data: [DONE]"
            assert srv.in_flight == 0
            assert c.post("/v1/completions", json=GREEDY).status_code == 200
            assert c.post("/v1/completions", json={"prompt": [-1]}).status_code == 400
            assert srv.in_flight == 0  # a refused request does not hold a place
    finally:
        srv.async_engine.shutdown()
