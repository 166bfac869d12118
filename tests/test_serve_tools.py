"""Tool calls and reasoning through the OpenAI server: Kimi's format parsed into `tool_calls` and
`reasoning_content`, streamed and not, tool messages rendered back through the template, and the requests
the server refuses by name. The bundled model cannot write tool calls, so its replies are scripted: a stand-in
for the async engine "generates" the token ids of a fixed text (the real engine's outputs, one per token)."""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from k3run.chat_output import ARG_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END  # noqa: E402
from k3run.cli import default_model_dir  # noqa: E402
from k3run.engine import EngineConfig, LLMEngine  # noqa: E402
from k3run.engine.async_engine import AsyncRequest  # noqa: E402
from k3run.engine.sequence import FinishReason, RequestOutput  # noqa: E402
from k3run.serve import OpenAIServer, build_app  # noqa: E402
from k3run.tokenizer import load_tokenizer  # noqa: E402

MODEL_DIR = default_model_dir()
pytestmark = pytest.mark.skipif(MODEL_DIR is None, reason="no bundled model")

# a Kimi-style template that declares tools and renders tool calls and results as K2's template does
KIMI_TOOLS_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'tool' -%}<|im_system|>tool<|im_middle|>## Return of {{ m['tool_call_id'] }}\n"
    "{{ m['content'] }}<|im_end|>"
    "{%- elif m['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>{{ m['content'] or '' }}"
    "{%- if m['tool_calls'] -%}<|tool_calls_section_begin|>{%- for c in m['tool_calls'] -%}"
    "<|tool_call_begin|>{{ c['id'] }}<|tool_call_argument_begin|>{{ c['function']['arguments'] }}"
    "<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}<|im_end|>"
    "{%- else -%}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if reasoning_effort and reasoning_effort != 'low' -%}<think>{%- endif -%}{%- endif -%}"
)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
]  # fmt: skip
CALL = (
    SECTION_BEGIN
    + f'{CALL_BEGIN}functions.get_weather:0{ARG_BEGIN}{{"city": "Paris"}}{CALL_END}'
    + SECTION_END
)
MODE_TOOL = {
    "type": "function",
    "function": {
        "name": "set_mode",
        "parameters": {
            "type": "object", "properties": {"mode": {"enum": ["on", "off"]}}, "required": ["mode"],
            "additionalProperties": False,
        },
    },
}  # fmt: skip
WANT_CALL = {
    "id": "functions.get_weather:0",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}


class Scripted:
    """The async engine's surface for the server: every request yields the ids of `reply` one token at a
    time, then the end-of-turn token (finish reason stop). `prompts` keeps what each request was given."""

    def __init__(self, tokenizer, reply: str) -> None:
        self.tokenizer, self.reply = tokenizer, reply
        self.prompts: list[list[int]] = []
        self._keys = itertools.count()

    def submit(self, prompt_ids, params) -> AsyncRequest:
        req = AsyncRequest(next(self._keys), prompt_ids, params, asyncio.get_running_loop())
        self.prompts.append(prompt_ids)
        ids = self.tokenizer.encode(self.reply, add_special_tokens=False)
        eos = self.tokenizer.token_to_id("<|im_end|>") or min(self.tokenizer.eos_token_ids)
        assert self.tokenizer.decode(ids, skip_special_tokens=False) == self.reply  # the script survives
        shown = ""
        for k in range(len(ids) + 1):
            done = k == len(ids)
            toks = ids[: k + 1] if not done else [*ids, eos]
            text = self.tokenizer.decode(toks[: len(ids)])
            out = RequestOutput(
                request_id=req.key, prompt="", prompt_token_ids=prompt_ids, text=text, token_ids=toks,
                finished=done, finish_reason=FinishReason.STOP if done else None, delta=text[len(shown) :],
            )  # fmt: skip
            shown = text
            req.loop.call_soon(req.queue.put_nowait, out)
        return req

    def abort(self, req) -> None:
        pass

    def counts(self) -> tuple[int, int]:
        return 0, 0

    def health(self, stall_s: float) -> None:
        return None

    def shutdown(self) -> None:
        pass


@pytest.fixture
def make_client(model):
    """make_client(reply, template) -> (TestClient, Scripted) for a server whose engine writes `reply`."""
    made = []

    def make(reply: str, template: str | None = KIMI_TOOLS_TEMPLATE):
        cfg = EngineConfig(max_num_seqs=2, max_model_len=512, max_num_batched_tokens=512)
        srv = OpenAIServer(LLMEngine(model, load_tokenizer(MODEL_DIR), cfg), "k3")
        srv.async_engine.shutdown()
        srv.async_engine = Scripted(srv.tokenizer, reply)  # type: ignore[assignment]
        if template is not None:
            srv.tokenizer.chat_template = template
        client = TestClient(build_app(srv))
        client.__enter__()
        made.append(client)
        return client, srv.async_engine

    yield make
    for c in made:
        c.__exit__(None, None, None)


def _chat(client, **body):
    body.setdefault("messages", [{"role": "user", "content": "Weather in Paris?"}])
    return client.post("/v1/chat/completions", json=body)


def _stream(client, **body) -> tuple[dict, str]:
    """The streamed deltas joined as a client joins them, and the last finish reason."""
    body.setdefault("messages", [{"role": "user", "content": "Weather in Paris?"}])
    with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    joined: dict = {}
    reason = None
    for ln in lines[:-1]:
        choice = json.loads(ln.removeprefix("data: "))["choices"][0]
        reason = choice["finish_reason"] or reason
        for key, value in choice["delta"].items():
            if key != "role":
                joined[key] = joined.get(key, [] if key == "tool_calls" else "") + value
    return joined, reason


def test_a_tool_call_comes_back_as_tool_calls(make_client) -> None:
    client, _ = make_client("<think>I need the weather.</think>\nLet me look." + CALL)
    r = _chat(client, tools=TOOLS)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["tool_calls"] == [WANT_CALL]
    assert msg["content"] == "Let me look." and msg["reasoning_content"] == "I need the weather."
    joined, reason = _stream(client, tools=TOOLS)
    assert reason == "tool_calls"
    assert joined == {
        "reasoning_content": "I need the weather.",
        "content": "Let me look.",
        "tool_calls": [{"index": 0} | WANT_CALL],
    }


@pytest.mark.parametrize(
    "reply",
    [
        CALL.replace('{"city": "Paris"}', "{city: Paris}"),  # not JSON
        CALL.replace("get_weather", "delete_everything"),  # not one of the request's tools
        CALL.removesuffix(SECTION_END),  # never closed
    ],
)
def test_invalid_tool_call_text_is_returned_as_text(make_client, reply: str) -> None:
    client, _ = make_client(reply)
    r = _chat(client, tools=TOOLS)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == reply
    joined, reason = _stream(client, tools=TOOLS)
    assert joined == {"content": reply} and reason == "stop"


def test_tool_choice_none_leaves_the_text_alone(make_client) -> None:
    client, _ = make_client(CALL)
    r = _chat(client, tools=TOOLS, tool_choice="none")
    msg = r.json()["choices"][0]["message"]
    assert r.status_code == 200 and msg["content"] == CALL and "tool_calls" not in msg


def test_tools_and_tool_results_are_rendered_through_the_template(make_client) -> None:
    client, engine = make_client("It is sunny in Paris.")
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [WANT_CALL]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": '{"sky": "clear"}'},
    ]
    r = _chat(client, messages=messages, tools=TOOLS)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny in Paris."}
    prompt = engine.tokenizer.decode(engine.prompts[-1], skip_special_tokens=False)
    assert prompt.startswith("<|im_system|>tool_declare<|im_middle|>") and '"get_weather"' in prompt
    assert CALL in prompt and '## Return of functions.get_weather:0\n{"sky": "clear"}' in prompt


def test_reasoning_effort_reaches_the_template(make_client) -> None:
    """The template opens <think> for medium / high effort: the reply starts inside the block."""
    client, engine = make_client("two plus two is four</think>4")
    r = _chat(client, reasoning_effort="high")
    msg = r.json()["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "4", "reasoning_content": "two plus two is four"}
    assert engine.tokenizer.decode(engine.prompts[-1], skip_special_tokens=False).endswith("<think>")
    joined, _ = _stream(client, reasoning_effort="high")
    assert joined == {"reasoning_content": "two plus two is four", "content": "4"}


def test_parallel_tool_calls_false_returns_the_first_call(make_client) -> None:
    second = f'{CALL_BEGIN}functions.get_weather:1{ARG_BEGIN}{{"city": "Rome"}}{CALL_END}'
    client, _ = make_client(CALL.replace(SECTION_END, second + SECTION_END))
    calls = _chat(client, tools=TOOLS).json()["choices"][0]["message"]["tool_calls"]
    assert [c["id"] for c in calls] == ["functions.get_weather:0", "functions.get_weather:1"]
    calls = _chat(client, tools=TOOLS, parallel_tool_calls=False).json()["choices"][0]["message"][
        "tool_calls"
    ]
    assert calls == [WANT_CALL]


@pytest.mark.parametrize(
    "body, param, message",
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not in 'tools'",
        ),  # fmt: skip
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "must be 'auto', 'none', 'required'"),
        ({"tool_choice": "auto"}, "tool_choice", "needs 'tools'"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "exclude each other",
        ),  # fmt: skip
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "letters"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]", "'type': 'function'"),
        ({"tools": TOOLS + TOOLS}, "tools[1].function.name", "given twice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]},
            "tools[0].function.strict",
            "constrained decoding",
        ),  # fmt: skip
        ({"reasoning_effort": "extreme"}, "reasoning_effort", "one of low, medium, high"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "must be a string"),
        (
            {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}]},
            "messages[0].tool_calls[0]",
            "must be",
        ),  # fmt: skip
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
            "messages[0].tool_calls",
            "not supported by this server for role 'user'",
        ),  # fmt: skip
    ],
)
def test_bad_tool_requests_name_the_field(make_client, body: dict, param: str, message: str) -> None:
    client, _ = make_client("unused")
    r = _chat(client, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err


def test_a_template_without_tools_refuses_them(make_client) -> None:
    """The bundled model's own template renders no tools, tool messages or reasoning effort: each is refused
    by name rather than silently dropped."""
    client, _ = make_client("unused", template=None)
    for body, param in [
        ({"tools": TOOLS}, "tools"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
    ]:
        r = _chat(client, **body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_forced_tool_call_is_opened_in_the_prompt_and_held_to_its_schema(model) -> None:
    """tool_choice naming a tool, on the real engine and the bundled model: the prompt ends by opening that
    call, the reply is sampled under the tool's parameter schema, and it comes back as that tool call,
    streamed and not."""
    choice = {"type": "function", "function": {"name": "set_mode"}}
    pytest.importorskip("xgrammar")
    cfg = EngineConfig(max_num_seqs=2, max_model_len=512, max_num_batched_tokens=512)
    srv = OpenAIServer(LLMEngine(model, load_tokenizer(MODEL_DIR), cfg), "k3")
    srv.tokenizer.chat_template = KIMI_TOOLS_TEMPLATE
    msgs = [{"role": "user", "content": "Turn it off."}]
    try:
        with TestClient(build_app(srv)) as client:
            for seed in (0, 1):
                body = {"messages": msgs, "tools": [MODE_TOOL], "tool_choice": choice, "max_tokens": 20}
                r = client.post("/v1/chat/completions", json=body | {"seed": seed})
                assert r.status_code == 200, r.text
                choice0 = r.json()["choices"][0]
                (call,) = choice0["message"]["tool_calls"]
                assert choice0["finish_reason"] == "tool_calls" and choice0["message"]["content"] is None
                assert call["id"] == "functions.set_mode:0" and call["function"]["name"] == "set_mode"
                assert json.loads(call["function"]["arguments"]) in ({"mode": "on"}, {"mode": "off"})
            joined, reason = _stream(client, **body)
            assert reason == "tool_calls" and joined["tool_calls"][0]["function"]["name"] == "set_mode"
            assert json.loads(joined["tool_calls"][0]["function"]["arguments"])["mode"] in ("on", "off")
        cp = srv.parser.chat_prompt(body)
        prompt = srv.tokenizer.decode(cp.ids, skip_special_tokens=False)
        assert prompt.endswith(f"{SECTION_BEGIN}{CALL_BEGIN}functions.set_mode:0{ARG_BEGIN}")
        assert json.loads(cp.json_schema) == MODE_TOOL["function"]["parameters"]
        assert cp.parse.forced == ("functions.set_mode:0", "set_mode")
    finally:
        srv.async_engine.shutdown()


LEVEL_TOOL = {
    "type": "function",
    "function": {
        "name": "set_level",
        "parameters": {
            "type": "object", "properties": {"level": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["level"], "additionalProperties": False,
        },
    },
}  # fmt: skip


def test_tool_choice_required_holds_the_reply_to_calls_of_the_tools(model) -> None:
    """tool_choice required with several tools, on the real engine and the bundled model (which has never
    seen a tool call): the prompt opens the tool-calls section and the sampler holds the reply to one
    well-formed call (parallel_tool_calls false) of one of the request's tools, its argument object valid for
    that tool's schema, then the section's end; greedy and sampled, streamed and not. (With parallel calls
    allowed this model never stops calling: tests/test_structured_output.py checks that structure.)"""
    pytest.importorskip("xgrammar")
    cfg = EngineConfig(max_num_seqs=2, max_model_len=512, max_num_batched_tokens=512)
    srv = OpenAIServer(LLMEngine(model, load_tokenizer(MODEL_DIR), cfg), "k3")
    srv.tokenizer.chat_template = KIMI_TOOLS_TEMPLATE
    levels = tuple({"level": i} for i in range(10))
    want = {"set_mode": ({"mode": "on"}, {"mode": "off"}), "set_level": levels}
    body = {
        "messages": [{"role": "user", "content": "Turn it off."}], "tools": [MODE_TOOL, LEVEL_TOOL],
        "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 200,
    }  # fmt: skip
    try:
        with TestClient(build_app(srv)) as client:
            names = set()
            for extra in ({"temperature": 0}, {"seed": 0}, {"seed": 1}, {"seed": 2}):
                r = client.post("/v1/chat/completions", json=body | extra)
                assert r.status_code == 200, r.text
                choice0 = r.json()["choices"][0]
                (call,) = choice0["message"]["tool_calls"]
                assert choice0["finish_reason"] == "tool_calls" and choice0["message"]["content"] is None
                name = call["function"]["name"]
                assert json.loads(call["function"]["arguments"]) in want[name], call
                assert call["id"].startswith(f"functions.{name}:")
                names.add(name)
                if extra.get("temperature") == 0:
                    greedy = call
            joined, reason = _stream(client, **body, temperature=0)
            assert reason == "tool_calls" and joined["tool_calls"] == [{"index": 0} | greedy]
        cp = srv.parser.chat_prompt(body)
        assert srv.tokenizer.decode(cp.ids, skip_special_tokens=False).endswith(SECTION_BEGIN)
        assert cp.parse.section_open and cp.structure is not None and cp.json_schema is None
    finally:
        srv.async_engine.shutdown()


def test_tool_choice_required_returns_every_call_of_the_section(make_client) -> None:
    """The reply to tool_choice required is the opened section's body: its calls (all of them, or the first
    without parallel calls), streamed and not; a body that is not valid calls comes back as text."""
    second = f'{CALL_BEGIN}functions.get_weather:1{ARG_BEGIN}{{"city": "Rome"}}{CALL_END}'
    body = CALL.removeprefix(SECTION_BEGIN).replace(SECTION_END, second + SECTION_END)
    client, scripted = make_client(body)
    r = _chat(client, tools=TOOLS, tool_choice="required")
    msg = r.json()["choices"][0]["message"]
    assert [c["id"] for c in msg["tool_calls"]] == ["functions.get_weather:0", "functions.get_weather:1"]
    assert msg["content"] is None and r.json()["choices"][0]["finish_reason"] == "tool_calls"
    assert scripted.tokenizer.decode(scripted.prompts[-1], skip_special_tokens=False).endswith(SECTION_BEGIN)
    joined, reason = _stream(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert reason == "tool_calls" and joined["tool_calls"] == [{"index": 0} | WANT_CALL]
    client, _ = make_client("not a call")
    for r in (_chat(client, tools=TOOLS, tool_choice="required"),):
        assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "not a call"}
    joined, reason = _stream(client, tools=TOOLS, tool_choice="required")
    assert joined == {"content": "not a call"} and reason == "stop"
