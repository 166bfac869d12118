"""Kimi chat output split into reasoning, content and tool calls (k3run.chat_output), whole and streamed."""

from __future__ import annotations

import json
import random

import pytest

from k3run.chat_output import (
    ARG_BEGIN,
    CALL_BEGIN,
    CALL_END,
    SECTION_BEGIN,
    SECTION_END,
    ParseOptions,
    StopCut,
    StreamParser,
    cut_at_stop,
    parse_output,
)

NAMES = frozenset({"get_weather", "search"})


def call(name: str, index: int, args: str) -> str:
    return f"{CALL_BEGIN}functions.{name}:{index}{ARG_BEGIN}{args}{CALL_END}"


def section(*calls: str) -> str:
    return SECTION_BEGIN + "".join(calls) + SECTION_END


TWO_CALLS = section(call("get_weather", 0, '{"city": "Paris"}'), call("search", 1, '{"q": "rain"}'))


def streamed(text: str, opts: ParseOptions, seed: int) -> dict:
    """The stream parser's deltas over random pieces of text, joined as a client joins them."""
    rng = random.Random(seed)
    parser, out, i = StreamParser(opts), [], 0
    while i < len(text):
        n = rng.choice([1, 1, 2, 3, 7, 20])
        out += parser.feed(text[i : i + n])
        i += n
    out += parser.finish()
    joined: dict = {}
    for d in out:
        for key, value in d.items():
            joined[key] = joined.get(key, [] if key == "tool_calls" else "") + value
    return joined


def whole(text: str, opts: ParseOptions) -> dict:
    co = parse_output(text, opts)
    out: dict = {}
    if co.reasoning:
        out["reasoning_content"] = co.reasoning
    if co.content:
        out["content"] = co.content
    if co.tool_calls:
        out["tool_calls"] = [c.openai(i) for i, c in enumerate(co.tool_calls)]
    return out


CASES = [
    # (text, options, expected fields)
    ("plain answer", ParseOptions(names=NAMES), {"content": "plain answer"}),
    (
        "<think>weigh it</think>\nLet me check." + TWO_CALLS,
        ParseOptions(names=NAMES),
        {
            "reasoning_content": "weigh it",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "index": 0,
                    "id": "functions.get_weather:0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "index": 1,
                    "id": "functions.search:1",
                    "type": "function",
                    "function": {"name": "search", "arguments": '{"q": "rain"}'},
                },
            ],
        },
    ),  # fmt: skip
    # the template opened the reasoning block: the output starts inside it
    (
        "step one, step two</think>The answer is 4.",
        ParseOptions(think_open=True),
        {"reasoning_content": "step one, step two", "content": "The answer is 4."},
    ),  # fmt: skip
    # a reasoning block cut off by the token limit is all reasoning
    ("<think>still thinking", ParseOptions(), {"reasoning_content": "still thinking"}),
    # tools not parsed when the request gave none (tool_choice "none" gives no names either)
    ("x" + TWO_CALLS, ParseOptions(), {"content": "x" + TWO_CALLS}),
    # invalid sections come back as the model wrote them
    (
        "x" + section(call("get_weather", 0, "{city: Paris}")),
        ParseOptions(names=NAMES),
        {"content": "x" + section(call("get_weather", 0, "{city: Paris}"))},
    ),  # fmt: skip
    (
        "x" + section(call("rm_rf", 0, "{}")),
        ParseOptions(names=NAMES),
        {"content": "x" + section(call("rm_rf", 0, "{}"))},
    ),  # fmt: skip
    (
        "x" + section(call("search", 0, "[1, 2]")),
        ParseOptions(names=NAMES),
        {"content": "x" + section(call("search", 0, "[1, 2]"))},
    ),  # fmt: skip
    (
        "x" + SECTION_BEGIN + call("search", 0, "{}"),
        ParseOptions(names=NAMES),
        {"content": "x" + SECTION_BEGIN + call("search", 0, "{}")},
    ),  # unterminated  # fmt: skip
    (
        SECTION_BEGIN + "functions.search:0" + ARG_BEGIN + "{}" + SECTION_END,
        ParseOptions(names=NAMES),
        {"content": SECTION_BEGIN + "functions.search:0" + ARG_BEGIN + "{}" + SECTION_END},
    ),  # fmt: skip
    # parallel_tool_calls false: the first call only
    (
        TWO_CALLS,
        ParseOptions(names=NAMES, parallel=False),
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "functions.get_weather:0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ]
        },
    ),  # fmt: skip
    # text that merely looks like the start of a marker is content
    ("a <|tool_c b <thin", ParseOptions(names=NAMES), {"content": "a <|tool_c b <thin"}),
    ("<thi", ParseOptions(names=NAMES), {"content": "<thi"}),
    ("ends in <|tool_calls_sec", ParseOptions(names=NAMES), {"content": "ends in <|tool_calls_sec"}),
    ("<think>a</think", ParseOptions(), {"reasoning_content": "a</think"}),
]


@pytest.mark.parametrize("text, opts, want", CASES)
def test_whole_output(text: str, opts: ParseOptions, want: dict) -> None:
    assert whole(text, opts) == want


@pytest.mark.parametrize("text, opts, want", CASES)
def test_streamed_output_equals_the_whole_one_for_any_split(
    text: str, opts: ParseOptions, want: dict
) -> None:
    for seed in range(25):
        assert streamed(text, opts, seed) == want, seed


def test_tool_call_arguments_stay_as_the_model_wrote_them() -> None:
    args = '{"q": "caf\\u00e9", "n": 3}'
    co = parse_output(section(call("search", 0, args)), ParseOptions(names=NAMES))
    assert co.tool_calls[0].arguments == args and json.loads(args) == {"q": "café", "n": 3}


def test_stop_strings_cut_streams_as_they_cut_whole_text() -> None:
    text = "alpha beta STOP gamma"
    assert cut_at_stop(text, ["STOP", "zz"]) == "alpha beta "
    for seed in range(20):
        rng, cut, out, i = random.Random(seed), StopCut(["STOP", "zz"]), "", 0
        while i < len(text):
            n = rng.randint(1, 4)
            out += cut.feed(text[i : i + n], final=i + n >= len(text))
            i += n
        assert out == "alpha beta ", seed
    cut = StopCut(["STOP"])
    assert cut.feed("no sto", False) + cut.feed("p here", True) == "no stop here"
