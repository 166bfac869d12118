"""The server as real clients meet it: the official `openai` Python client against a live uvicorn
(completions, chat, streaming, tool calls, errors), 64 concurrent clients, and a seeded fuzz of request
bodies that must never get a 500 or hurt the next request."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from k3run.cli import default_model_dir  # noqa: E402
from k3run.engine import LLM, EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from k3run.serve import OpenAIServer, build_app  # noqa: E402
from k3run.tokenizer import load_tokenizer  # noqa: E402
from tests.test_serve_faults import live  # noqa: E402

MODEL_DIR = default_model_dir()
pytestmark = pytest.mark.skipif(MODEL_DIR is None, reason="no bundled model")
CONFIG = EngineConfig(max_num_seqs=8, max_model_len=128, max_num_batched_tokens=256)


@pytest.fixture
def server(model):
    srv = OpenAIServer(LLMEngine(model, load_tokenizer(MODEL_DIR), CONFIG), "k3")
    yield srv
    srv.async_engine.shutdown()


def _greedy(model, prompt, max_tokens: int) -> str:
    llm = LLM.from_model(model, load_tokenizer(MODEL_DIR), CONFIG)
    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0].text


def test_the_openai_client(server, model) -> None:
    openai = pytest.importorskip("openai")
    with live(server) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["k3"]
        c = client.completions.create(model="k3", prompt="def ", max_tokens=8, temperature=0)
        assert c.choices[0].text == _greedy(model, "def ", 8) and c.usage.completion_tokens <= 8
        msgs = [{"role": "user", "content": "What does `json.dumps` do?"}]
        chat = client.chat.completions.create(model="k3", messages=msgs, max_tokens=16, temperature=0)
        text = chat.choices[0].message.content
        parts = client.chat.completions.create(
            model="k3", messages=msgs, max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = list(parts)
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
        assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="k3", prompt=[-1], max_tokens=4)
        assert err.value.body["param"] == "prompt"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gpt-9", prompt="x", max_tokens=2)


def test_the_openai_client_parses_tool_calls(model) -> None:
    """The scripted Kimi tool call (test_serve_tools) read back by the official client, streamed and not."""
    openai = pytest.importorskip("openai")
    from tests.test_serve_tools import CALL, KIMI_TOOLS_TEMPLATE, TOOLS, Scripted

    srv = OpenAIServer(LLMEngine(model, load_tokenizer(MODEL_DIR), CONFIG), "k3")
    srv.async_engine.shutdown()
    srv.async_engine = Scripted(srv.tokenizer, "<think>look it up</think>" + CALL)  # type: ignore[assignment]
    srv.tokenizer.chat_template = KIMI_TOOLS_TEMPLATE
    with live(srv) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        msgs = [{"role": "user", "content": "Weather in Paris?"}]
        r = client.chat.completions.create(model="k3", messages=msgs, tools=TOOLS)
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls"
        assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
            "functions.get_weather:0", "get_weather", {"city": "Paris"},
        )  # fmt: skip
        stream = client.chat.completions.create(model="k3", messages=msgs, tools=TOOLS, stream=True)
        calls = [tc for ch in stream for tc in (ch.choices[0].delta.tool_calls or [])]
        assert [(c.index, c.function.name) for c in calls] == [(0, "get_weather")]


def test_64_concurrent_clients_all_get_their_own_answer(server, model) -> None:
    """64 clients at once on 8 sequence slots: every one gets 200 and its own greedy text (the queue, not
    a failure, absorbs the excess)."""
    prompts = [f"def f{i}(" for i in range(64)]

    async def run(url: str) -> list[tuple[int, str]]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:

            async def one(p: str) -> tuple[int, str]:
                r = await c.post("/v1/completions", json={"prompt": p, "max_tokens": 6, "temperature": 0})
                return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text

            return await asyncio.gather(*[one(p) for p in prompts])

    with live(server) as url:
        results = asyncio.run(run(url))
    assert all(status == 200 for status, _ in results), [r for r in results if r[0] != 200][:3]
    for i in (0, 17, 63):  # spot checks against single runs
        assert results[i][1] == _greedy(model, prompts[i], 6)


JUNK_STRINGS = ["", "x", "<|im_end|>", "\u0000", "\U0001f4a5" * 3]


def _junk(rng: random.Random, depth: int = 0):
    """A random JSON value: numbers of every sign and size (NaN included), odd strings, nested containers."""
    k = rng.randrange(9 if depth < 3 else 7)
    if k == 0:
        return rng.randint(0, 50)
    if k == 1:
        return -rng.randint(1, 10**6)
    if k == 2:
        return 2 ** rng.randint(40, 90)
    if k == 3:
        return rng.choice([0.5, -1.0, 1e308, float("nan")])
    if k == 4:
        return rng.choice(JUNK_STRINGS)
    if k == 5:
        return rng.random() < 0.5
    if k == 6:
        return None
    if k == 7:
        return [_junk(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    keys = ["role", "content", "type", "name", "x"]
    return {rng.choice(keys): _junk(rng, depth + 1) for _ in range(rng.randint(0, 3))}


FIELDS = [
    "prompt", "messages", "max_tokens", "temperature", "top_p", "n", "stream", "stop", "seed", "logprobs",
    "top_logprobs", "echo", "tools", "tool_choice", "response_format", "reasoning_effort", "stream_options",
    "stop_token_ids", "ignore_eos", "top_k", "model", "unknown_field",
]  # fmt: skip


def test_fuzzed_bodies_never_get_a_500_and_leave_the_server_working(server) -> None:
    """520 random bodies (each a valid request with one to three fields replaced by junk: wrong types, huge
    and negative numbers, NaN, nested objects, special-token text), seeded: every answer is 200, 400, 404 or
    413 in OpenAI's error shape, and a greedy request answers afterwards exactly as it did before."""
    rng = random.Random(1234)
    greedy = {"prompt": "def ", "max_tokens": 8, "temperature": 0}
    with TestClient(build_app(server), raise_server_exceptions=False) as c:
        before = c.post("/v1/completions", json=greedy)
        assert before.status_code == 200
        sent = 0
        for i in range(520):
            chat = i % 2 == 0
            body = (
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
                if chat
                else {"prompt": "def ", "max_tokens": 3}
            )
            for _ in range(rng.randint(1, 3)):
                body[rng.choice(FIELDS)] = _junk(rng)
            path = "/v1/chat/completions" if chat else "/v1/completions"
            try:
                payload = json.dumps(body, allow_nan=True)
            except (TypeError, ValueError):
                continue
            r = c.post(path, content=payload, headers={"content-type": "application/json"})
            sent += 1
            assert r.status_code in (200, 400, 404, 413), (r.status_code, body, r.text[:300])
            if r.status_code != 200 and "text/event-stream" not in r.headers.get("content-type", ""):
                err = r.json()["error"]
                assert err["message"] and "Traceback" not in err["message"], (body, err)
        after = c.post("/v1/completions", json=greedy)
        assert after.status_code == 200 and not server.engine.has_unfinished()
        assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
        assert sent >= 500, sent  # bodies json.dumps could not write are skipped
