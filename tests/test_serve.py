"""The OpenAI-compatible server (k3run.serve) on the bundled model, via FastAPI's TestClient and directly."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from k3run.cli import default_model_dir  # noqa: E402
from k3run.engine import LLM, EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from k3run.serve import OpenAIServer, build_app  # noqa: E402
from k3run.tokenizer import load_tokenizer  # noqa: E402

MODEL_DIR = default_model_dir()
pytestmark = pytest.mark.skipif(MODEL_DIR is None, reason="no bundled model")
CONFIG = EngineConfig(max_num_seqs=4, max_model_len=96, max_num_batched_tokens=128)
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(params=[None, True], ids=["sync", "overlap"])
def server(model, request):
    """Every server test runs with plain steps and with decode overlap forced on (each decode step launched
    before the previous one is recorded; on the CPU only the bookkeeping differs): the same responses."""
    cfg = dataclasses.replace(CONFIG, overlap_decode=request.param)
    srv = OpenAIServer(LLMEngine(model, load_tokenizer(MODEL_DIR), cfg), "k3")
    yield srv
    srv.async_engine.shutdown()


@pytest.fixture
def client(server):
    with TestClient(build_app(server)) as c:
        yield c


def _greedy(model, prompt: str | list[int], max_tokens: int) -> str:
    llm = LLM.from_model(model, load_tokenizer(MODEL_DIR), CONFIG)
    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0].text


def test_models_and_greedy_completion(client, model):
    assert client.get("/v1/models").json()["data"][0]["id"] == "k3"
    r = client.post(
        "/v1/completions", json={"model": "k3", "prompt": "def ", "max_tokens": 12, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["choices"][0]["text"] == _greedy(model, "def ", 12)
    usage = body["usage"]
    assert (
        usage["prompt_tokens"] > 0
        and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    )


def test_streaming_matches_the_plain_response(client):
    req = {"prompt": "import ", "max_tokens": 10, "temperature": 0, "stream": True}
    with client.stream("POST", "/v1/completions", json=req) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length") and "usage" not in chunks[-1]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    plain = client.post("/v1/completions", json={**req, "stream": False}).json()["choices"][0]["text"]
    assert streamed == plain


def test_concurrent_requests_are_batched_and_each_matches_its_single_run(server, model):
    """Three requests in flight at once share engine steps (continuous batching); greedy fp32 results equal
    single runs."""
    prompts = ["def ", "class ", "import os\n"]

    async def run_all():
        results = await asyncio.gather(
            *[server.complete({"prompt": p, "max_tokens": 10, "temperature": 0}, chat=False) for p in prompts]
        )
        return [res["choices"][0]["text"] for res, _ in results]

    steps = []
    engine = server.engine
    step = engine.step

    def counting_step():
        outs = step()
        steps.append(len(outs))
        return outs

    engine.step = counting_step
    texts = asyncio.run(run_all())
    assert texts == [_greedy(model, p, 10) for p in prompts]
    assert max(steps) > 1  # at least one step decoded several requests together


def test_chat_completion_works_out_of_the_box(client, server):
    """The bundled model ships a chat template and stops at <|im_end|>: the README's request answers 200 with
    an assistant message, and no role marker leaks into it."""
    msgs = [{"role": "user", "content": "What does `json.dumps` do?"}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 64, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    content = choice["message"]["content"]
    assert body["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    assert content.strip() and "<|" not in content, content
    # ended by <|im_end|> (an eos, not counted in the text), not by the token limit
    assert choice["finish_reason"] == "stop" and body["usage"]["completion_tokens"] < 64, body
    rendered = server.tokenizer.apply_chat_template(msgs)
    assert rendered.startswith("<|im_user|>user<|im_middle|>") and rendered.endswith("<|im_middle|>")
    # without a template the endpoint says so (a checkpoint that ships none)
    saved, server.tokenizer.chat_template = server.tokenizer.chat_template, None
    try:
        r = client.post("/v1/chat/completions", json={"messages": msgs})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    finally:
        server.tokenizer.chat_template = saved


def test_chat_completion_uses_the_template(client, server, model):
    saved, server.tokenizer.chat_template = server.tokenizer.chat_template, TEMPLATE
    try:
        msgs = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "x ="}]},
        ]
        r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
        rendered = server.tokenizer.apply_chat_template([msgs[0], {"role": "user", "content": "x ="}])
        ids = server.tokenizer.encode(rendered, add_special_tokens=False)
        assert body["choices"][0]["message"]["content"] == _greedy(model, ids, 8)
        with client.stream(
            "POST",
            "/v1/chat/completions",
            json={"messages": msgs, "max_tokens": 8, "temperature": 0, "stream": True},
        ) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line and line != "data: [DONE]"]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert (
            "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
            == body["choices"][0]["message"]["content"]
        )
    finally:
        server.tokenizer.chat_template = saved


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"prompt": ["x", 3]}, 400, "prompt"),
        ({"prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "x", "stop": [1]}, 400, "stop"),
        ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ({"prompt": "x", "logprobs": True}, 400, "logprobs"),
        ({"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
        ({"prompt": 5}, 400, "prompt"),
        ({"prompt": [1, 2, 10**9]}, 400, "prompt"),
        ({"prompt": "x " * 200}, 400, "prompt"),
        ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ],
)
def test_bad_requests_name_the_field(client, body, status, param):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err


def test_malformed_json_is_a_400(client):
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json=[1, 2])
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]


def test_a_closed_stream_aborts_its_request(server):
    """Closing the event stream early (a client that went away) aborts the request and frees its slot."""

    async def start_and_close():
        _, stream = await server.complete(
            {"prompt": "def ", "max_tokens": 80, "temperature": 0, "stream": True}, False
        )
        first = await stream.__anext__()
        await stream.aclose()
        return first

    first = asyncio.run(start_and_close())
    assert first.startswith("data: ")
    deadline = time.time() + 10
    while server.engine.has_unfinished() and time.time() < deadline:
        time.sleep(0.02)
    assert not server.engine.has_unfinished()


def test_a_failed_step_fails_the_requests_in_flight_and_the_server_carries_on(client, server, model):
    engine = server.engine
    step = engine.step
    calls = {"n": 0}

    def failing_once():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device fell over")
        return step()

    engine.step = failing_once
    r = client.post("/v1/completions", json={"prompt": "def ", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 500 and "device fell over" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "server_error"
    r = client.post("/v1/completions", json={"prompt": "def ", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == _greedy(model, "def ", 4)


def test_stream_usage_when_asked(client):
    req = {"prompt": "def ", "max_tokens": 6, "temperature": 0, "stream": True}
    with client.stream(
        "POST", "/v1/completions", json=req | {"stream_options": {"include_usage": True}}
    ) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line and line != "data: [DONE]"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_several_prompts_and_choices(client, model):
    """A list of prompts gives one choice each, in order; n > 1 samples per prompt, seeded choices differ."""
    r = client.post("/v1/completions", json={"prompt": ["def ", "class "], "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert [c["text"] for c in choices] == [_greedy(model, "def ", 8), _greedy(model, "class ", 8)]
    req = {"prompt": "def ", "max_tokens": 12, "temperature": 1.0, "seed": 7, "n": 3}
    body = client.post("/v1/completions", json=req).json()
    texts = [c["text"] for c in body["choices"]]
    assert len(set(texts)) > 1 and body["usage"]["completion_tokens"] == 36
    assert client.post("/v1/completions", json=req).json()["choices"] == body["choices"]  # seeded: repeatable
    with client.stream("POST", "/v1/completions", json=req | {"stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line and line != "data: [DONE]"]
    streamed = [
        "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in range(3)
    ]
    assert streamed == texts


@pytest.mark.parametrize("n", [0, 65])
def test_choice_count_limits(client, n):
    r = client.post("/v1/completions", json={"prompt": "x", "n": n})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_completion_logprobs(client, server, model):
    """logprobs=k: one entry per generated token, the values the engine computes (log_softmax of the raw
    logits), streamed in pieces that add up to the same list."""
    req = {"prompt": "def ", "max_tokens": 6, "temperature": 0, "logprobs": 2}
    body = client.post("/v1/completions", json=req).json()
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == body["usage"]["completion_tokens"] == 6
    llm = LLM.from_model(model, load_tokenizer(MODEL_DIR), CONFIG)
    ref = llm.generate(["def "], SamplingParams(max_tokens=6, temperature=0.0, logprobs=2))[0].logprobs
    assert lp["token_logprobs"] == [x.logprob for x in ref]
    assert all(
        len(top) <= 2 and max(top.values()) == t for top, t in zip(lp["top_logprobs"], lp["token_logprobs"])
    )
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    with client.stream("POST", "/v1/completions", json=req | {"stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line and line != "data: [DONE]"]
    streamed = [v for c in chunks for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == lp["token_logprobs"]
    assert [v for c in chunks for v in c["choices"][0]["logprobs"]["text_offset"]] == lp["text_offset"]
    assert client.post("/v1/completions", json={"prompt": "x"}).json()["choices"][0]["logprobs"] is None


def test_chat_logprobs(client, server):
    saved, server.tokenizer.chat_template = server.tokenizer.chat_template, TEMPLATE
    try:
        msgs = [{"role": "user", "content": "x ="}]
        r = client.post(
            "/v1/chat/completions",
            json={"messages": msgs, "max_tokens": 4, "temperature": 0, "top_logprobs": 2},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
        req = {"messages": msgs, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2}
        body = client.post("/v1/chat/completions", json=req).json()
        content = body["choices"][0]["logprobs"]["content"]
        assert len(content) == body["usage"]["completion_tokens"]
        for e in content:
            assert (
                e["logprob"] <= 0 and e["bytes"] == list(e["token"].encode()) and len(e["top_logprobs"]) == 2
            )
            assert e["top_logprobs"][0]["logprob"] == e["logprob"]  # greedy: the chosen token is the top one
        with client.stream("POST", "/v1/chat/completions", json=req | {"stream": True}) as st:
            chunks = [json.loads(line[6:]) for line in st.iter_lines() if line and line != "data: [DONE]"]
        streamed = [
            e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]
        ]
        assert streamed == content  # streamed in pieces that add up to the same entries
    finally:
        server.tokenizer.chat_template = saved


def test_echo_scores_the_prompt(client, model):
    """echo + logprobs + max_tokens 0 (how evaluation harnesses score text): the prompt comes back with each
    token's log-probability given the ones before it (the first is null), and nothing is generated."""
    prompt = "import os\nimport sys\n"
    body = client.post(
        "/v1/completions",
        json={"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0},
    ).json()
    choice = body["choices"][0]
    assert choice["text"] == prompt and body["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    llm = LLM.from_model(model, load_tokenizer(MODEL_DIR), CONFIG)
    ref = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    assert len(lp["tokens"]) == len(ref.prompt_token_ids) == body["usage"]["prompt_tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == [e.logprob for e in ref.prompt_logprobs[1:]]
    # echo with generation: prompt then completion, one logprob per token of both
    body = client.post(
        "/v1/completions",
        json={"prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 0, "temperature": 0},
    ).json()
    assert body["choices"][0]["text"].startswith(prompt) and len(body["choices"][0]["text"]) > len(prompt)
    assert len(body["choices"][0]["logprobs"]["tokens"]) == body["usage"]["prompt_tokens"] + 3
    r = client.post("/v1/completions", json={"prompt": prompt, "echo": True, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
