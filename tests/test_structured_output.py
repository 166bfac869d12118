"""Structured output (engine/grammar.py, serve's response_format): the token masks of each grammar backend,
constrained generation on the bundled model, and the server's fields. The bundled model knows no JSON, so an
unconstrained reply would never parse: a reply that parses and follows the schema shows the constraint."""

from __future__ import annotations

import json

import pytest
import torch

from k3run.cli import default_model_dir
from k3run.engine import LLM, EngineConfig, SamplingParams
from k3run.engine.grammar import GrammarBackend, GrammarError

MODEL_DIR = default_model_dir()
pytestmark = pytest.mark.skipif(MODEL_DIR is None, reason="no bundled model")
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"enum": ["low", "high"]}},
    "required": ["answer", "confidence"],
    "additionalProperties": False,
}
BACKENDS = [
    pytest.param(name, marks=pytest.mark.skipif(not _installed, reason=f"{name} not installed"))
    for name, _installed in (
        ("xgrammar", __import__("importlib").util.find_spec("xgrammar") is not None),
        ("llguidance", __import__("importlib").util.find_spec("llguidance") is not None),
    )
]


@pytest.fixture(scope="module")
def tokenizer():
    from k3run.tokenizer import load_tokenizer

    return load_tokenizer(MODEL_DIR)


@pytest.mark.parametrize("name", BACKENDS)
def test_masks_allow_exactly_the_schema(tokenizer, name: str) -> None:
    """Walking a valid document token by token: each of its tokens is allowed by the mask before it; at the
    start every allowed token decodes to a prefix of '{"answer":' (the compact form), and at the end only
    the end-of-sequence tokens are."""
    backend = GrammarBackend(tokenizer, tokenizer.vocab_size, prefer=name)
    schema = json.dumps(SCHEMA)
    m = backend.matcher(schema)
    doc = tokenizer.encode('{"answer":"no","confidence":"high"}', add_special_tokens=False)
    logits = torch.zeros(1, tokenizer.vocab_size)
    first = backend.mask_logits(logits, [m])[0]
    allowed = (first > float("-inf")).nonzero().flatten().tolist()
    assert allowed and all('{"answer":'.startswith(tokenizer.decode([t])) for t in allowed), allowed[:10]
    for t in doc:
        assert backend.mask_logits(logits, [m])[0, t] == 0, t
        assert backend.consume(m, t)
    last = backend.mask_logits(logits, [m])[0]
    assert set((last > float("-inf")).nonzero().flatten().tolist()) <= set(tokenizer.eos_token_ids)
    none = torch.randn(2, tokenizer.vocab_size)
    assert torch.equal(backend.mask_logits(none, [None, None]), none)  # unconstrained rows untouched


@pytest.mark.parametrize("name", BACKENDS)
def test_bad_schemas_are_refused_with_the_backends_message(tokenizer, name: str) -> None:
    backend = GrammarBackend(tokenizer, tokenizer.vocab_size, prefer=name)
    with pytest.raises(GrammarError, match="the JSON schema cannot be used"):
        backend.compile(json.dumps({"type": "object", "properties": 5}))


@pytest.mark.parametrize("name", BACKENDS)
def test_the_tool_calls_structure_on_both_backends(tokenizer, name: str) -> None:
    """chat_output.calls_structure (tool_choice required, Kimi's K2-style section after its opening marker):
    one or more calls of the given tools, compact arguments of each tool's schema, then the end marker (here
    the markers are spelled in text: the bundled tokenizer has no tokens for them); without parallel calls
    exactly one. Both backends agree on every case."""
    from k3run.chat_output import ARG_BEGIN, CALL_BEGIN, CALL_END, SECTION_END, calls_structure

    backend = GrammarBackend(tokenizer, tokenizer.vocab_size, prefer=name)
    tools = [
        {"type": "function", "function": {"name": "answer", "parameters": SCHEMA}},
        {"type": "function", "function": {"name": "noop"}},
    ]

    def call(name: str, i: int, args: str) -> str:
        return f"{CALL_BEGIN}functions.{name}:{i}{ARG_BEGIN}{args}{CALL_END}"

    def accepts(structure: str, text: str) -> bool:
        m = backend.matcher_for(None, structure)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return all(backend.consume(m, t) for t in ids) and backend.consume(m, min(tokenizer.eos_token_ids))

    many, one = calls_structure(tokenizer, tools, True), calls_structure(tokenizer, tools, False)
    good = call("answer", 0, '{"answer":"no","confidence":"high"}')
    assert accepts(many, good + SECTION_END) and accepts(one, good + SECTION_END)
    assert accepts(many, good + call("noop", 1, "{}") + SECTION_END)
    assert not accepts(one, good + call("noop", 1, "{}") + SECTION_END)
    assert not accepts(many, SECTION_END)  # at least one call
    assert not accepts(many, call("answer", 0, '{"answer":"maybe","confidence":"high"}') + SECTION_END)
    assert not accepts(many, call("answer", 0, '{"answer": "no","confidence":"high"}') + SECTION_END)
    assert not accepts(many, call("other", 0, "{}") + SECTION_END)
    assert not accepts(many, good)  # the section must end


def test_constrained_generation_follows_the_schema(model, tokenizer) -> None:
    """Greedy and sampled replies (batched with an unconstrained one) are documents of the schema, ended
    by the model's end-of-sequence token; the unconstrained row in the same batch is unaffected."""
    llm = LLM.from_model(model, tokenizer, EngineConfig(max_num_seqs=4, max_model_len=256))
    schema = json.dumps(SCHEMA)
    params = [
        SamplingParams(max_tokens=40, temperature=t, seed=3, json_schema=schema) for t in (0.0, 1.0, 1.5)
    ]
    free = SamplingParams(max_tokens=12, temperature=0.0)
    outs = llm.generate(["Is water wet?", "def f():", "x", "import "], [*params, free])
    for o in outs[:3]:
        doc = json.loads(o.text)
        assert doc["answer"] in ("yes", "no") and doc["confidence"] in ("low", "high") and len(doc) == 2, (
            o.text
        )
        assert o.finish_reason.value == "stop"
    alone = LLM.from_model(model, tokenizer, EngineConfig(max_num_seqs=4, max_model_len=256))
    assert outs[3].text == alone.generate(["import "], free)[0].text


def test_response_format_through_the_server(model) -> None:
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from k3run.engine import LLMEngine
    from k3run.serve import OpenAIServer, build_app
    from k3run.tokenizer import load_tokenizer

    srv = OpenAIServer(
        LLMEngine(model, load_tokenizer(MODEL_DIR), EngineConfig(max_num_seqs=2, max_model_len=256)), "k3"
    )
    msgs = [{"role": "user", "content": "Is water wet?"}]
    try:
        with TestClient(build_app(srv)) as c:
            fmt = {
                "type": "json_schema",
                "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True},
            }
            r = c.post(
                "/v1/chat/completions", json={"messages": msgs, "response_format": fmt, "max_tokens": 40}
            )
            assert r.status_code == 200, r.text
            doc = json.loads(r.json()["choices"][0]["message"]["content"])
            assert set(doc) == {"answer", "confidence"}
            with c.stream(
                "POST",
                "/v1/chat/completions",
                json={"messages": msgs, "response_format": fmt, "max_tokens": 40, "stream": True},
            ) as s:
                text = "".join(
                    json.loads(ln.removeprefix("data: "))["choices"][0]["delta"].get("content", "")
                    for ln in s.iter_lines() if ln and ln != "data: [DONE]"
                )  # fmt: skip
            assert set(json.loads(text)) == {"answer", "confidence"}
            r = c.post(
                "/v1/chat/completions",
                json={
                    "messages": msgs,
                    "response_format": {"type": "json_object"},
                    "max_tokens": 60,
                    "seed": 1,
                },
            )
            body = r.json()["choices"][0]
            if body["finish_reason"] == "stop":  # an object the model closed; else cut by max_tokens
                assert isinstance(json.loads(body["message"]["content"]), dict)
            else:
                assert body["message"]["content"].startswith("{")
            bad_schema = {"schema": {"type": "object", "properties": 5}}
            for fmt, param in [
                ({"type": "json_schema", "json_schema": bad_schema}, "response_format"),
                ({"type": "yaml"}, "response_format.type"),
                ({"type": "json_schema", "json_schema": "x"}, "response_format.json_schema"),
                ({"type": "json_schema", "json_schema": {"x": 1}}, "response_format.json_schema.x"),
            ]:  # fmt: skip
                r = c.post("/v1/chat/completions", json={"messages": msgs, "response_format": fmt})
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    finally:
        srv.async_engine.shutdown()
