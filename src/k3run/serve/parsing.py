"""`RequestParser`: an OpenAI request body checked field by field (`protocol`), its prompts tokenized or
its conversation rendered (the model's chat template, or K3's own format by `chat_xtml`), and what the
reply is held to (a JSON schema or a tool-call structure, compiled here so the engine finds it cached).

Runs on a worker thread, never on the event loop; of the engine it touches only the grammar backend's
compile cache, which holds a lock.
"""

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

from k3run import chat_xtml
from k3run.chat_output import ARG_BEGIN, CALL_BEGIN, SECTION_BEGIN, THINK_BEGIN, ParseOptions, calls_structure
from k3run.chat_xtml import XtmlError, XtmlOptions
from k3run.engine import SamplingParams
from k3run.serve.protocol import (
    EFFORTS,
    MAX_CHOICES,
    ServeError,
    check_fields,
    check_message,
    check_tools,
    get_field,
    response_schema,
    sampling_params,
    tool_choice,
)

if TYPE_CHECKING:
    from k3run.engine.grammar import GrammarBackend


@dataclass
class ParsedRequest:
    """A validated, tokenized request, before it reaches the engine."""

    prompts: list[list[int]]
    params: SamplingParams
    n: int
    echoes: list[str] | None  # per prompt: its text for echo, or None without echo
    stream: bool
    include_usage: bool
    score_only: bool
    parse: ParseOptions | XtmlOptions | None = None  # chat: reasoning / tool calls to split out of the output


@dataclass
class ChatPrompt:
    """A rendered conversation: its ids, what to split out of the reply (None: plain text), and what the
    reply is held to: a JSON schema or a structure (engine/grammar.py), with the request field it comes
    from; extra stop token ids (the format's end of turn)."""

    ids: list[int]
    parse: ParseOptions | XtmlOptions | None = None
    json_schema: str | None = None
    structure: str | None = None
    constraint_field: str = "response_format"
    stop_ids: tuple[int, ...] = ()


class RequestParser:
    """Validates and tokenizes request bodies for one model. `grammars` returns the engine's grammar
    backend (engine/grammar.py)."""

    def __init__(
        self,
        tokenizer: Any,
        model_name: str,
        max_model_len: int,
        vocab_size: int,
        grammars: Callable[[], "GrammarBackend"],
    ) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.grammars = grammars
        # K3's chat format (its tokenizer has the XTML markup tokens): rendered by chat_xtml, not a template
        self.xtml = chat_xtml.is_xtml(tokenizer)

    def check_model(self, body: dict[str, Any]) -> None:
        name = get_field(body, "model", (str,), self.model_name)
        if name != self.model_name:
            raise ServeError(
                404,
                f"model '{name}' does not exist; this server serves '{self.model_name}'",
                "model",
                "not_found_error",
            )

    def prompt_ids(self, body: dict[str, Any]) -> list[list[int]]:
        """One or several prompts, each a string or a list of token ids in [0, vocab)."""
        prompt = body.get("prompt")

        def is_ids(p: Any) -> TypeGuard[list[int]]:
            return (
                isinstance(p, list)
                and bool(p)
                and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
            )

        if isinstance(prompt, str):
            prompts = [self.tokenizer.encode(prompt)]
        elif is_ids(prompt):
            prompts = [list(prompt)]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
            prompts = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]
        else:
            raise ServeError(
                400, "'prompt' must be a string, a list of token ids, or a non-empty list of either", "prompt"
            )
        for ids in prompts:
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ServeError(
                    400, f"'prompt' token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
                    "prompt",
                )  # fmt: skip
        return prompts

    def _template_fields(
        self, template: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]], effort: str | None
    ) -> dict[str, Any]:
        """The template arguments beyond the messages (tools, reasoning_effort). Fields the model's template
        does not read would be silently ignored: they are refused instead, as are tool messages it cannot
        render."""
        extra: dict[str, Any] = {}
        if tools:
            if "tools" not in template:
                raise ServeError(
                    400, f"the chat template of '{self.model_name}' does not render tools", "tools"
                )
            extra["tools"] = tools
        if effort is not None:
            if effort not in EFFORTS:
                raise ServeError(
                    400, f"'reasoning_effort' must be one of {', '.join(EFFORTS)}, got {effort!r}",
                    "reasoning_effort",
                )  # fmt: skip
            if "reasoning_effort" not in template:
                raise ServeError(
                    400, f"the chat template of '{self.model_name}' takes no reasoning_effort",
                    "reasoning_effort",
                )  # fmt: skip
            extra["reasoning_effort"] = effort
        for i, m in enumerate(messages):
            if (m["role"] == "tool" or "tool_calls" in m) and "tool" not in template:
                raise ServeError(
                    400, f"the chat template of '{self.model_name}' does not render tool messages",
                    f"messages[{i}]",
                )  # fmt: skip
        return extra

    def chat_prompt(self, body: dict[str, Any]) -> ChatPrompt:
        """The rendered, tokenized conversation, what to split out of the reply and what holds it."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ServeError(400, "'messages' must be a non-empty list", "messages")
        messages = [check_message(i, m) for i, m in enumerate(messages)]
        tools = check_tools(body)
        choice = tool_choice(body, tools)
        parallel = get_field(body, "parallel_tool_calls", (bool,), True)
        effort = get_field(body, "reasoning_effort", (str,), None)
        if isinstance(choice, dict) or choice == "required":
            if body.get("response_format") not in (None, {"type": "text"}):
                raise ServeError(
                    400, "'response_format' and a forced 'tool_choice' exclude each other", "tool_choice"
                )
        if self.xtml:
            return self._xtml_prompt(body, messages, tools, choice, parallel, effort)
        template = self.tokenizer.chat_template
        if template is None:
            raise ServeError(
                400, f"model '{self.model_name}' has no chat template: use /v1/completions", "messages"
            )
        extra = self._template_fields(template, messages, tools, effort)
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)
        names = frozenset(t["function"]["name"] for t in tools)
        if isinstance(choice, dict):  # a forced call: open it in the prompt, hold the reply to its schema
            name = choice["function"]["name"]
            call_id = f"functions.{name}:0"
            text += f"{SECTION_BEGIN}{CALL_BEGIN}{call_id}{ARG_BEGIN}"
            schema = json.dumps(choice["function"].get("parameters") or {"type": "object"})
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            return ChatPrompt(ids, ParseOptions(forced=(call_id, name)), schema, constraint_field="tools")
        if choice == "required":  # open the tool-calls section, hold the reply to calls of the tools
            text += SECTION_BEGIN
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            structure = calls_structure(self.tokenizer, tools, parallel)
            required = ParseOptions(names=names, parallel=parallel, section_open=True)
            return ChatPrompt(ids, required, structure=structure, constraint_field="tools")
        think_open = text.rstrip().endswith(THINK_BEGIN)
        opts: ParseOptions | None = None
        if (names and choice == "auto") or think_open or THINK_BEGIN in template:
            opts = ParseOptions(think_open=think_open, names=names if choice == "auto" else frozenset(),
                                parallel=parallel)  # fmt: skip
        # the template writes its own special tokens (BOS included)
        return ChatPrompt(self.tokenizer.encode(text, add_special_tokens=False), opts, response_schema(body))

    def _xtml_prompt(
        self, body: dict[str, Any], messages: list[dict[str, Any]], tools: list[dict[str, Any]],
        choice: str | dict[str, Any], parallel: bool, effort: str | None,
    ) -> ChatPrompt:  # fmt: skip
        """chat_prompt for K3's format (chat_xtml): rendered by k3run, constrained replies as structures."""
        thinking = effort != "none"
        schema_text = response_schema(body)
        schema = json.loads(schema_text) if schema_text is not None else None
        json_object = schema is not None and body["response_format"].get("type") == "json_object"
        forced = [choice] if isinstance(choice, dict) else tools if choice == "required" else []
        try:
            segments = chat_xtml.render(
                messages, tools, thinking=thinking, effort=effort if thinking else None,
                tool_choice="required" if forced else choice if isinstance(choice, str) else "auto",
                response_schema=None if json_object else schema, json_object=json_object,
            )  # fmt: skip
            ids = chat_xtml.encode(self.tokenizer, segments)
        except XtmlError as e:
            raise ServeError(400, str(e), e.field or "messages") from e
        names = frozenset(t["function"]["name"] for t in tools) if choice != "none" else frozenset()
        single = isinstance(choice, dict)
        opts = XtmlOptions(thinking=thinking, names=names, parallel=parallel and not single)
        structure, field = None, "response_format"
        if forced:
            structure = chat_xtml.reply_structure(
                self.tokenizer, thinking=thinking, tools=forced, parallel=parallel and not single
            )
            field = "tools"
        elif schema is not None:
            structure = chat_xtml.reply_structure(self.tokenizer, thinking=thinking, response_schema=schema)
        end = self.tokenizer.token_to_id(chat_xtml.END_OF_MSG)
        return ChatPrompt(ids, opts, structure=structure, constraint_field=field, stop_ids=(end,))

    def parse(self, body: dict[str, Any], chat: bool) -> "ParsedRequest":
        """Validate and tokenize a request body (no engine access: runs on a worker thread)."""
        if not isinstance(body, dict):
            raise ServeError(400, "the request body must be a JSON object")
        self.check_model(body)
        check_fields(body, chat)
        opts, chat_prompt = None, None
        if chat:
            chat_prompt = self.chat_prompt(body)
            opts = chat_prompt.parse
            prompts = [chat_prompt.ids]
        else:
            prompts = self.prompt_ids(body)
        n = get_field(body, "n", (int,), 1)
        longest = self._check_sizes(prompts, n, chat)
        stream = get_field(body, "stream", (bool,), False)
        echo = not chat and get_field(body, "echo", (bool,), False)
        if echo and stream:
            raise ServeError(400, "'echo' with 'stream' is not supported", "echo")
        # scoring a prompt: max_tokens 0 with echo (one token is generated and dropped)
        score_only = echo and body.get("max_tokens") == 0
        room = self.max_model_len - longest
        params = sampling_params(
            body | {"max_tokens": 1} if score_only else body, room if chat else min(16, room), chat,
            self.vocab_size,
        )  # fmt: skip
        if params.max_tokens > room:
            name = "max_completion_tokens" if "max_tokens" not in body else "max_tokens"
            raise ServeError(
                400,
                f"'{name}' is {params.max_tokens}, but the prompt has {longest} tokens and this server's "
                f"max_model_len is {self.max_model_len}: at most {room} can be generated",
                name,
            )
        if chat_prompt is not None:
            params = self._chat_constraints(chat_prompt, params)
        options = get_field(body, "stream_options", (dict,), {})
        for key in options:
            if key != "include_usage":
                raise ServeError(400, f"stream_options.{key} is not supported", f"stream_options.{key}")
        include_usage = get_field(options, "include_usage", (bool,), False)
        texts = self._echo_texts(body.get("prompt")) if echo else None
        return ParsedRequest(prompts, params, n, texts, stream, include_usage, score_only, opts)

    def _check_sizes(self, prompts: list[list[int]], n: int, chat: bool) -> int:
        """Refuse too many choices or a prompt at max_model_len; returns the longest prompt's length."""
        if not 1 <= n <= MAX_CHOICES:
            raise ServeError(400, f"'n' must be in [1, {MAX_CHOICES}], got {n}", "n")
        if len(prompts) * n > MAX_CHOICES:
            raise ServeError(400, f"{len(prompts)} prompts x n={n} is over {MAX_CHOICES} choices", "n")
        longest = max(len(ids) for ids in prompts)
        if longest >= self.max_model_len:
            raise ServeError(
                400,
                f"the prompt has {longest} tokens; this server's max_model_len is {self.max_model_len}",
                "messages" if chat else "prompt",
            )
        return longest

    def _chat_constraints(self, cp: ChatPrompt, params: SamplingParams) -> SamplingParams:
        """params with the chat request's output constraint (its grammar compiled here, on the worker
        thread, so the engine finds it in its cache) and its template's stop tokens."""
        if cp.json_schema is not None or cp.structure is not None:
            from k3run.engine.grammar import GrammarError

            try:
                if cp.structure is not None:
                    self.grammars().compile_structure(cp.structure)
                elif cp.json_schema is not None:
                    self.grammars().compile(cp.json_schema)
            except GrammarError as e:
                raise ServeError(400, f"{cp.constraint_field}: {e}", cp.constraint_field) from e
            params = dataclasses.replace(params, json_schema=cp.json_schema, grammar=cp.structure)
        if cp.stop_ids:
            params = dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids, *cp.stop_ids))
        return params

    def _echo_texts(self, raw: object) -> list[str]:
        """The prompts as given (strings) or decoded (token ids), for echo."""
        if not isinstance(raw, (str, list)):
            raise RuntimeError(f"echo: 'prompt' passed validation as {type(raw).__name__}")
        items = [raw] if isinstance(raw, str) or (raw and not isinstance(raw[0], (str, list))) else raw
        return [p if isinstance(p, str) else self.tokenizer.decode(p) for p in items]
