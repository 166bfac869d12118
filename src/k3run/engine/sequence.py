"""Requests as the engine sees them: sampling parameters, per-sequence state, and the output handed back."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability; `top`: the k most likely tokens' (descending)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 means greedy (argmax). top_k 0 and top_p 1.0 disable those filters. `seed` gives the request
    its own random generator, so its tokens do not depend on which other requests share the batch.
    Stop strings are removed from the returned text (the text ends just before the first match); stop token
    ids and eos finish the sequence and are kept in `token_ids` but not rendered in the text.
    """

    max_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # None: no log-probabilities; k >= 0: each generated token's log-probability under the model (raw logits,
    # before temperature / top-k / top-p) and the k most likely tokens with theirs
    logprobs: int | None = None
    # the same for the prompt's tokens (the first has none: nothing precedes it)
    prompt_logprobs: int | None = None
    # a JSON schema (as JSON text) the generated text must follow (engine/grammar.py), or None
    json_schema: str | None = None
    # or a structure in engine/grammar.py's node language (JSON text): a chat format's tool-call markup
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.json_schema is not None and self.grammar is not None:
            raise ValueError("SamplingParams takes json_schema or grammar, not both")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"SamplingParams.seed must be in [0, 2**64), got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"SamplingParams.{name} must be in [0, {MAX_LOGPROBS}] or None, got {k}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(s == "" for s in self.stop):
            raise ValueError("SamplingParams.stop must not contain an empty string")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the engine's max_model_len
    ABORT = "abort"


@dataclass
class Sequence:
    """One request in flight. `num_cached` counts the tokens whose state is already in the cache slot."""

    seq_id: int
    prompt: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    slot: int | None = None
    num_cached: int = 0
    generator: torch.Generator | None = None
    matcher: Any = None  # the schema's grammar matcher when params.json_schema is set
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    output_text: str = ""
    # incremental detokenisation offsets into all_token_ids (see Detokenizer)
    prefix_offset: int = 0
    read_offset: int = 0
    # characters of output_text already handed to a streaming consumer
    num_streamed_chars: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.seq_id}: the prompt encodes to zero tokens")
        if self.params.seed is not None:
            self.generator = torch.Generator(device="cpu")
            self.generator.manual_seed(self.params.seed)
        # decoding starts with a few prompt tokens as context so the first output token keeps its leading
        # space (tokenizers that mark word starts drop it when a token is decoded alone)
        self.prefix_offset = max(len(self.prompt_token_ids) - 5, 0)
        self.read_offset = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncached(self) -> int:
        return self.num_tokens - self.num_cached

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def finish(self, reason: FinishReason) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason


class SequenceIds:
    """Hands out request ids; one per engine, so two engines never share a counter."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def next(self) -> int:
        return next(self._counter)


@dataclass(frozen=True)
class RequestOutput:
    """What `LLM.generate` returns per prompt (and what the streaming API yields, with `delta` set)."""

    request_id: int
    prompt: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    delta: str = ""
    # one per token in token_ids when SamplingParams.logprobs is set
    logprobs: list[TokenLogprob] | None = None
    # one per prompt token (the first None) when SamplingParams.prompt_logprobs is set, once it is read
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @classmethod
    def from_sequence(cls, seq: Sequence, delta: str = "") -> RequestOutput:
        return cls(
            request_id=seq.seq_id,
            prompt=seq.prompt,
            prompt_token_ids=list(seq.prompt_token_ids),
            text=seq.output_text,
            token_ids=list(seq.output_token_ids),
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            delta=delta,
            logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
            prompt_logprobs=list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None else None,
        )
