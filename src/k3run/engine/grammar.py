"""Constrained decoding: sampled tokens restricted to a JSON schema (structured output).

Two backends, the same contract: xgrammar (the `serve` extra, first because its per-token mask at batch 32
costs ~1 us per sequence against llguidance's 6-15 us on 2K-65K vocabularies: bench/bench_grammar.py)
and llguidance (used when xgrammar is not installed; it compiles a schema ~10x faster and has no
dependencies). A request's `SamplingParams.json_schema` is compiled once per engine and schema (cached); each
such sequence gets a matcher. Before each sampling step the matcher's token mask sets every disallowed logit
to -inf (the log-probabilities a request reports stay those of the model), and the sampled token is then
consumed by the matcher. The end-of-sequence tokens are allowed exactly where the schema's document can end.
JSON is constrained to the compact form (no whitespace between tokens), so a model cannot spend its tokens
on indentation. Masks are computed on the host, so constrained sequences decode without overlap.

Beside JSON schemas, a request can carry a structure (`SamplingParams.grammar`): k3run's own small grammar
language, JSON of nested nodes, which the chat formats use to hold a reply to Kimi's tool-call markup
(special tokens around JSON or typed arguments). Nodes:
    {"token": id}                 one token, by id (a chat format's special marker)
    {"text": "..."}               literal text
    {"regex": "..."}              text matching a regular expression
    {"json": schema, "style": s}  a JSON value of the schema; style "json" (compact) or "kimi_k3_xml"
                                  (K3's typed argument tags, xgrammar only; "excludes": strings its
                                  text values may not contain)
    {"any_text": [excluded strings]}
    {"seq": [nodes]}, {"or": [nodes]}, {"plus": node}, {"optional": node}
xgrammar compiles it as a structural tag, llguidance as a Lark grammar (without the K3-only nodes).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import torch

from k3run.tokenizer import Tokenizer


class GrammarError(ValueError):
    """A schema the backend cannot use (the message is the backend's)."""


def backend_name() -> str | None:
    """ "xgrammar" or "llguidance", whichever is installed (xgrammar first), or None."""
    for name in ("xgrammar", "llguidance"):
        try:
            __import__(name)
            return name
        except ImportError:
            continue
    return None


class GrammarBackend:
    """One engine's grammar backend: its view of the tokenizer (built once: it reads the whole vocabulary),
    the compiled schemas, and the per-step masks."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, prefer: str | None = None) -> None:
        self.name = prefer or backend_name()
        if self.name is None:
            raise GrammarError("structured output needs xgrammar or llguidance (pip install 'k3run[serve]')")
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._compiled: dict[str, Any] = {}
        self._markup_compiler: Any = None
        if self.name == "xgrammar":
            import xgrammar as xgr

            self._xgr = xgr
            self._compiler = xgr.GrammarCompiler(tokenizer.xgrammar_tokenizer_info(vocab_size))
        elif self.name == "llguidance":
            import llguidance

            self._ll = llguidance
            self._lltok = tokenizer.llguidance_tokenizer(vocab_size)
        else:
            raise GrammarError(f"unknown grammar backend {self.name!r}")

    def _cached(self, key: str, what: str, build: Any) -> Any:
        """build()'s compiled grammar, kept under `key`; GrammarError naming `what` if the backend refuses it
        (llguidance's grammars are validated here, xgrammar raises while compiling)."""
        with self._lock:
            if key in self._compiled:
                return self._compiled[key]
        try:
            compiled = build()
            if self.name == "llguidance":
                is_error, messages = self._ll.LLMatcher.validate_grammar_with_warnings(compiled)
                if is_error:
                    raise GrammarError("; ".join(messages))
        except Exception as e:  # GrammarError, and the plain exceptions both libraries raise for bad input
            raise GrammarError(f"the {what} cannot be used: {e}") from e
        with self._lock:
            self._compiled[key] = compiled
        return compiled

    def compile(self, schema: str) -> Any:
        """The compiled JSON schema (text), cached; GrammarError if the backend cannot use it."""

        def build() -> Any:
            if self.name == "xgrammar":
                return self._compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
            spec = json.loads(schema)
            if isinstance(spec, dict):
                spec = {"x-guidance": {"whitespace_flexible": False}} | spec
            return self._ll.LLMatcher.grammar_from_json_schema(json.dumps(spec))

        return self._cached(schema, "JSON schema", build)

    def compile_structure(self, spec: str) -> Any:
        """The compiled structure (module docstring; JSON text), cached; GrammarError if it cannot be used."""

        def build() -> Any:
            node = json.loads(spec)
            if self.name == "xgrammar":
                tag = {"type": "structural_tag", "format": _xgrammar_format(node)}
                return self._markup().compile_structural_tag(json.dumps(tag))
            return self._ll.LLMatcher.grammar_from_lark(_lark(node))

        return self._cached("structure:" + spec, "tool-call grammar", build)

    def _markup(self) -> Any:
        """xgrammar's compiler over a vocabulary where special tokens read as their text (the structures
        name markers by token; JSON schemas compile with the plain one, where special tokens never match)."""
        if getattr(self._tokenizer, "xgrammar_specials_as_text", False):
            return self._compiler
        with self._lock:
            if self._markup_compiler is None:
                info = self._tokenizer.xgrammar_tokenizer_info(self.vocab_size, special_text=True)
                self._markup_compiler = self._xgr.GrammarCompiler(info)
            return self._markup_compiler

    def matcher_for(self, json_schema: str | None, structure: str | None) -> Any:
        """A matcher for a request's schema or structure (at most one is set), or None."""
        if structure is not None:
            return self._new_matcher(self.compile_structure(structure))
        if json_schema is not None:
            return self.matcher(json_schema)
        return None

    def matcher(self, schema: str) -> Any:
        return self._new_matcher(self.compile(schema))

    def _new_matcher(self, compiled: Any) -> Any:
        if self.name == "xgrammar":
            return self._xgr.GrammarMatcher(compiled)
        m = self._ll.LLMatcher(self._lltok, compiled, log_level=0)
        if m.is_error():
            raise GrammarError(f"the grammar cannot be used: {m.get_error()}")
        return m

    def consume(self, matcher: Any, token: int) -> bool:
        """Advance the matcher by a sampled token; False if it refuses the token (it cannot, after a mask)."""
        if self.name == "xgrammar":
            return bool(matcher.accept_token(token))
        return bool(matcher.consume_token(token))

    def fill_bitmask(self, matchers: list[Any]) -> torch.Tensor:
        """int32 [len(matchers), ceil(V / 32)]: bit t of row i set where matchers[i] allows token t (host)."""
        words = (self.vocab_size + 31) // 32
        bitmask = torch.empty(len(matchers), words, dtype=torch.int32)
        for i, m in enumerate(matchers):
            if self.name == "xgrammar":
                m.fill_next_token_bitmask(bitmask, i)
            else:  # llguidance may count one more id than the model's width (its own eos): cut to the width
                bitmask[i] = torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.int32)[:words]
        return bitmask

    def mask_logits(self, logits: torch.Tensor, matchers: list[Any]) -> torch.Tensor:
        """logits [B, V] with each constrained row's disallowed tokens at -inf (one copy of the logits; rows
        without a matcher untouched). The masks are filled on the host as 32-bit words and applied on the
        logits' device (xgrammar's own kernel; llguidance's words unpacked by torch there)."""
        rows = [b for b, m in enumerate(matchers) if m is not None]
        if not rows:
            return logits
        bitmask = self.fill_bitmask([matchers[b] for b in rows]).to(logits.device, non_blocking=True)
        out = logits.float().clone()
        if self.name == "xgrammar":
            self._xgr.apply_token_bitmask_inplace(out, bitmask, vocab_size=self.vocab_size, indices=rows)
        else:
            bits = torch.arange(32, dtype=torch.int32, device=out.device)
            allowed = ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)[:, : out.shape[1]]
            out[rows] = out[rows].masked_fill(~allowed, float("-inf"))
        return out


_XML_STYLES = ("kimi_k3_xml",)


def _xgrammar_format(node: dict[str, Any]) -> dict[str, Any]:
    """A structure node as xgrammar's structural-tag format (as a dict)."""
    if "token" in node:
        return {"type": "token", "token": int(node["token"])}
    if "text" in node:
        return {"type": "const_string", "value": node["text"]}
    if "regex" in node:
        return {"type": "regex", "pattern": node["regex"]}
    if "json" in node:
        style = node.get("style", "json")
        if style != "json":  # strings and names exclude node["excludes"] (a format's markers)
            out = {"type": "json_schema", "json_schema": node["json"], "style": style}
            return out | {"excludes": list(node.get("excludes", []))}
        import xgrammar as xgr

        # compact JSON, as for response_format (a structural tag's json_schema allows whitespace)
        schema = json.dumps(node["json"])
        grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=(",", ":"))
        return {"type": "grammar", "grammar": str(grammar)}
    if "any_text" in node:
        return {"type": "any_text", "excludes": list(node["any_text"])}
    if "seq" in node:
        return {"type": "sequence", "elements": [_xgrammar_format(n) for n in node["seq"]]}
    if "or" in node:
        return {"type": "or", "elements": [_xgrammar_format(n) for n in node["or"]]}
    if "plus" in node:
        return {"type": "plus", "content": _xgrammar_format(node["plus"])}
    if "optional" in node:
        return {"type": "optional", "content": _xgrammar_format(node["optional"])}
    raise GrammarError(f"unknown structure node {sorted(node)}")


def _lark(node: dict[str, Any]) -> str:
    """A structure as a Lark grammar for llguidance: one rule per JSON schema (`%json`), tokens as <[id]>."""
    rules: list[str] = []

    def expr(n: dict[str, Any]) -> str:
        if "token" in n:
            return f"<[{int(n['token'])}]>"
        if "text" in n:
            return json.dumps(n["text"])
        if "regex" in n:
            return "/" + n["regex"].replace("/", "\\/") + "/"
        if "json" in n:
            if n.get("style", "json") in _XML_STYLES:
                raise GrammarError(
                    f"the {n['style']} argument style needs xgrammar (pip install 'k3run[serve]')"
                )
            name = f"json{len(rules)}"
            spec = n["json"] if isinstance(n["json"], dict) else {}
            rules.append(
                f"{name}: %json " + json.dumps({"x-guidance": {"whitespace_flexible": False}} | spec)
            )
            return name
        if "any_text" in n:
            raise GrammarError(
                "free text inside a tool-call structure needs xgrammar (pip install 'k3run[serve]')"
            )
        if "seq" in n:
            return "(" + " ".join(expr(c) for c in n["seq"]) + ")"
        if "or" in n:
            return "(" + " | ".join(expr(c) for c in n["or"]) + ")"
        if "plus" in n:
            return "(" + expr(n["plus"]) + ")+"
        if "optional" in n:
            return "(" + expr(n["optional"]) + ")?"
        raise GrammarError(f"unknown structure node {sorted(n)}")

    start = "start: " + expr(node)
    return "\n".join([start, *rules]) + "\n"
