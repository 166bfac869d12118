"""The engine loop (add requests, step, stream) and the `LLM` convenience API on top of it."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from k3run.chat_output import incremental_decode
from k3run.config import ModelConfig
from k3run.engine.cache import CacheManager, build_cache_manager, cache_layout_for
from k3run.engine.grammar import GrammarBackend
from k3run.engine.prefix_cache import PrefixCache
from k3run.engine.runner import (
    DEFAULT_GRAPH_STEP_BYTES,
    GRAPH_BATCH_SIZES,
    PREFILL_GRAPH_TOKENS,
    CausalLM,
    CompiledCpuDecoder,
    GraphDecoder,
    ModelRunner,
    PrefillGraphs,
    StepPlan,
    batch_ids,
    prefill_buckets,
    staged,
)
from k3run.engine.sampler import Sampler
from k3run.engine.scheduler import Batch, Scheduler, SchedulerConfig
from k3run.engine.sequence import (
    FinishReason,
    RequestOutput,
    SamplingParams,
    Sequence,
    SequenceIds,
    TokenLogprob,
)
from k3run.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)


class EngineModel(CausalLM, Protocol):
    config: ModelConfig

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]: ...


@dataclass(frozen=True)
class EngineConfig:
    """Engine limits. The cache holds min(max_num_seqs, what cache_bytes fits) sequences of max_model_len."""

    max_num_seqs: int = 8
    max_model_len: int = 2048
    max_num_batched_tokens: int = 2048
    cache_bytes: int | None = None
    seed: int = 0  # generator for requests without their own seed
    tp_size: int = 1  # ranks of the (world) process group sharing the model; every rank runs the engine
    cuda_graphs: bool = True  # on CUDA: replay decode steps from CUDA graphs where the model allows it
    # the most temporaries a captured decode step may hold (its MLA attention window's copies grow with
    # batch x window); steps over it decode eagerly. None: no limit
    graph_step_bytes: int | None = DEFAULT_GRAPH_STEP_BYTES
    # launch decode step k + 1 (fed by step k's sampled tokens on the device) before the host reads and
    # records step k's tokens, so the host's per-step work overlaps the GPU's. None: on where decode steps
    # replay CUDA graphs; True: wherever a step is a plain decode (the CPU too: for tests, no gain there)
    overlap_decode: bool | None = None
    # on the CPU: decode steps compiled by torch.compile (engine/runner.py CompiledCpuDecoder; the batch and
    # window symbolic, ~40-60 s per path on first use: batch 1, small and large batches), at tensor-parallel
    # size 1
    compile_cpu_decode: bool = False
    # ... with Inductor's C++ wrapper (no Python between the step's kernels): 1.25-1.7x the decode rate of the
    # bundled model against the Python wrapper, ~130 s instead of ~30 s to compile a step on 2 cores the
    # first time (~13 s from the disk cache); implies compile_cpu_decode
    compile_cpu_cpp_wrapper: bool = False
    # bytes of prompt-prefix snapshots kept for reuse (engine/prefix_cache.py); 0: no prefix caching
    prefix_cache_bytes: int = 0
    # with decode graphs on CUDA: a prefill of one fresh prompt of up to this many tokens replays a CUDA graph
    # of its token bucket (engine/runner.py PrefillGraphs); 0: prefills run eagerly
    prefill_graph_tokens: int = 4096


class Detokenizer:
    """Incremental detokenisation: decode a short window so multi-byte characters and word-start spaces come
    out right, and hold back text while the window ends in an incomplete UTF-8 sequence."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def step(self, seq: Sequence, flush: bool = False) -> str:
        delta, seq.prefix_offset, seq.read_offset = incremental_decode(
            self.tokenizer, seq.all_token_ids, seq.prefix_offset, seq.read_offset, flush
        )
        return delta


def _model_device_dtype(model: EngineModel) -> tuple[torch.device, torch.dtype]:
    # KimiForCausalLM states its activation dtype; otherwise take the first 16/32-bit matrix (the embedding;
    # quantized weights are uint8 / fp8 and their scales are not matrices of the activation dtype)
    device, dtype = None, getattr(model, "params_dtype", None)
    for p in model.parameters():
        device = device or p.device
        if dtype is None and p.is_floating_point() and p.dim() == 2 and p.element_size() >= 2:
            dtype = p.dtype
        if device is not None and dtype is not None:
            break
    if device is None or dtype is None:
        raise ValueError("cannot tell the model's device and activation dtype: it has no 2-D float parameter")
    return device, dtype


def _token_logprobs(logits: torch.Tensor, targets: list[int], ks: list[int]) -> list[TokenLogprob]:
    """Row r: the log-probability of token targets[r] under log_softmax(logits[r]) (raw fp32 logits) and the
    ks[r] most likely tokens with theirs."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None])[:, 0].tolist()
    k = max(ks)
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    top_vs, top_is = top_v.tolist(), top_i.tolist()
    return [
        TokenLogprob(t, c, tuple(zip(ti[:n], tv[:n])))
        for t, c, ti, tv, n in zip(targets, chosen, top_is, top_vs, ks)
    ]


def _record_logprobs(seqs: list[Sequence], logits: torch.Tensor, tokens: list[int]) -> None:
    """Append each sampled token's log-probability and top k to the sequences that asked for them."""
    want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if want:
        ks = [seqs[i].params.logprobs or 0 for i in want]
        entries = _token_logprobs(logits[want], [tokens[i] for i in want], ks)
        for i, entry in zip(want, entries):
            seqs[i].output_logprobs.append(entry)


def _record_prompt_logprobs(seq: Sequence, logits: torch.Tensor) -> None:
    """Logits of the prompt positions fed this step ([n, vocab], before the scheduler advances num_cached):
    position j predicts token num_cached + j + 1; those inside the prompt are recorded."""
    prompt = seq.prompt_token_ids
    if not seq.prompt_logprobs:
        seq.prompt_logprobs.append(None)  # the first prompt token: nothing precedes it
    start = seq.num_cached
    n = min(logits.shape[0], len(prompt) - 1 - start)
    if n > 0:
        targets = prompt[start + 1 : start + 1 + n]
        seq.prompt_logprobs.extend(
            _token_logprobs(logits[:n], targets, [seq.params.prompt_logprobs or 0] * n)
        )


@dataclass
class _InFlight:
    """A decode step launched but not yet recorded: its sampled tokens on the device and a pinned host copy
    that is valid once `ready` has passed (None on the CPU, where the copy is done on return)."""

    batch: Batch
    tokens: torch.Tensor  # [B] int64 on the model's device (rank 0's under tensor parallelism)
    host: torch.Tensor  # [B] int64
    ready: torch.cuda.Event | None


class LLMEngine:
    """Requests in, tokens and text out, one `step()` at a time.

    Decode overlap (EngineConfig.overlap_decode): while only decode steps run (nothing waits for a prefill
    and no running sequence wants log-probabilities), `step()` launches the next decode step, fed by this
    step's sampled tokens still on the device, before it reads and records this step's tokens. The host's
    work (reading the tokens, stop checks, detokenising, scheduling, building the next inputs) then runs
    while the GPU computes, instead of between steps. A sequence that turns out to have finished (an EOS or
    stop string in the tokens just read) has computed one extra row in the step already launched; that row
    is dropped (its slot is freed, and whatever takes the slot next starts after that step in stream
    order). Greedy and seeded requests produce the same tokens with and without overlap; an unseeded
    request's draws come from the shared generator, so a dropped row's draw shifts the later ones.
    """

    def __init__(self, model: EngineModel, tokenizer: Tokenizer, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        if model.config.vocab_size < tokenizer.vocab_size:
            raise ValueError(
                f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                f"{model.config.vocab_size}"
            )
        device, act_dtype = _model_device_dtype(model)
        layout = cache_layout_for(model.config, act_dtype, self.config.tp_size)
        graph_batch, self.graph_blocker = self._graph_plan(model, device)
        graphs = self.graph_blocker is None
        self.cache: CacheManager = build_cache_manager(
            layout,
            device=device,
            max_len=self.config.max_model_len,
            max_num_seqs=self.config.max_num_seqs + graphs,  # + the graph decoder's scratch slot
            cache_bytes=self.config.cache_bytes,
        )
        decoder = None
        if graphs and self.cache.num_slots < 2:
            self.graph_blocker = "the cache holds one sequence, and the graph decoder needs a scratch slot"
        elif graphs:
            kind = GraphDecoder if device.type == "cuda" else CompiledCpuDecoder
            decoder = kind(model, self.cache, graph_batch, self.config.graph_step_bytes)
            if isinstance(decoder, CompiledCpuDecoder):
                decoder.cpp_wrapper = self.config.compile_cpu_cpp_wrapper
        if self.graph_blocker is not None and device.type == "cuda":
            log.info("decode runs eagerly: %s", self.graph_blocker)
        prefill_graphs = None
        self.prefill_graph_blocker = self._prefill_graph_plan(model, decoder)
        if self.prefill_graph_blocker is None:
            assert isinstance(decoder, GraphDecoder)
            prefill_graphs = PrefillGraphs(model, self.cache, decoder.scratch, self._prefill_graph_top())
        elif device.type == "cuda":
            log.info("prefills run eagerly: %s", self.prefill_graph_blocker)
        self.prefix_cache = (
            PrefixCache(self.cache, self.config.prefix_cache_bytes)
            if self.config.prefix_cache_bytes
            else None
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=min(self.config.max_num_seqs, self.cache.num_free),
                max_num_batched_tokens=self.config.max_num_batched_tokens,
                max_model_len=self.config.max_model_len,
            ),
            self.cache,
            self.prefix_cache,
        )
        self.runner = ModelRunner(model, self.cache, decoder, prefill_graphs)
        self.sampler = Sampler(torch.Generator(device="cpu").manual_seed(self.config.seed))
        self.detokenizer = Detokenizer(tokenizer)
        self._ids = SequenceIds()
        overlap = self.config.overlap_decode
        self.overlap = decoder is not None and device.type == "cuda" if overlap is None else overlap
        self._inflight: _InFlight | None = None
        self._grammars: GrammarBackend | None = None

    def _prefill_graph_top(self) -> int:
        c = self.config
        return min(c.prefill_graph_tokens, c.max_num_batched_tokens, c.max_model_len)

    def _prefill_graph_plan(self, model: EngineModel, decoder: object) -> str | None:
        """None when fresh prompts prefill from CUDA graphs, else why they run eagerly."""
        if not isinstance(decoder, GraphDecoder) or isinstance(decoder, CompiledCpuDecoder):
            return "decode graphs are off"
        buckets = prefill_buckets(self._prefill_graph_top())
        if not buckets:
            return f"prefill_graph_tokens / max_num_batched_tokens hold no bucket of {PREFILL_GRAPH_TOKENS}"
        check = getattr(model, "padded_prefill_blocker", None)
        if check is None:
            return f"{type(model).__name__} has no padded prefill"
        return check(buckets[-1])

    def _graph_plan(self, model: EngineModel, device: torch.device) -> tuple[int, str | None]:
        """(the largest decode batch replayed from a CUDA graph, None) or (0, why decode runs eagerly).
        Larger batches than the first run eagerly (the grouped NVFP4 experts have a pick limit, say)."""
        if not self.config.cuda_graphs:
            return 0, "CUDA graphs are off (EngineConfig.cuda_graphs / --eager)"
        if device.type == "cpu" and not (
            self.config.compile_cpu_decode or self.config.compile_cpu_cpp_wrapper
        ):
            return 0, "the model is on the CPU and EngineConfig.compile_cpu_decode is off"
        if device.type not in ("cuda", "cpu"):
            return 0, f"the model is on {device}"
        check = getattr(model, "static_decode_blocker", None)
        if check is None:
            return 0, f"{type(model).__name__} has no static decode step"
        why = None
        for b in reversed(GRAPH_BATCH_SIZES):
            if b < 2 * self.config.max_num_seqs:  # the smallest bucket holding max_num_seqs and below
                why = check(b)
                if why is None:
                    return min(b, self.config.max_num_seqs), None
        return 0, why

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> int:
        params = params or SamplingParams()
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        # checked before decoding: the tokenizer's own decode overflows on a negative id
        bad = [t for t in ids if not 0 <= t < self.model.config.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.model.config.vocab_size})"
            )
        if not isinstance(prompt, str):
            text = self.tokenizer.decode(ids)
        seq = Sequence(seq_id=self._ids.next(), prompt=text, prompt_token_ids=ids, params=params)
        if params.json_schema is not None or params.grammar is not None:
            seq.matcher = self.grammars().matcher_for(params.json_schema, params.grammar)
        self.scheduler.add(seq)
        return seq.seq_id

    def grammars(self) -> GrammarBackend:
        """The constrained-decoding backend (built on first use: it reads the whole vocabulary)."""
        if self._grammars is None:
            self._grammars = GrammarBackend(self.tokenizer, self.model.config.vocab_size)
        return self._grammars

    def abort(self, request_id: int) -> None:
        self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One model step. Returns an output (with the newly streamable text in `delta`) for every sequence
        that produced a token; a finished sequence appears once, with `finished` set. With decode overlap
        the outputs are those of the step launched by the previous call (see the class)."""
        cur, self._inflight = self._inflight, None
        if cur is None:
            batch = self.scheduler.schedule()
            if batch is None:
                return []
            plan = self.runner.plan(batch)
            if not self._overlaps(batch, plan):
                return self._step_sync(batch, plan)
            cur = self._launch(batch, plan, prev=None)
        nxt = self._lookahead(cur)
        if nxt is not None:
            self._inflight = self._launch(*nxt, prev=cur)
        outputs = self._record(cur)
        if self._inflight is not None and all(s.is_finished for s in self._inflight.batch.seqs):
            self._inflight = None  # every row of the launched step belongs to a finished sequence
        return outputs

    def _step_sync(self, batch: Batch, plan: StepPlan) -> list[RequestOutput]:
        out = self.runner.run(batch, plan)
        rows, logits = out.rows, out.logits
        for b, plogits in out.prompt_logits.items():
            _record_prompt_logprobs(batch.seqs[b], plogits)
        sampled: list[int | None] = [None] * len(batch.seqs)
        if rows:
            assert logits is not None
            seqs = [batch.seqs[b] for b in rows]
            matchers = [s.matcher for s in seqs]
            sample_from = logits
            if any(m is not None for m in matchers):  # grammar-constrained rows: disallowed tokens at -inf
                sample_from = self.grammars().mask_logits(logits, matchers)
            tokens = self.sampler(sample_from, [s.params for s in seqs], [s.generator for s in seqs])
            if self.config.tp_size > 1:
                tokens = self._agree(tokens, logits.device)
            for m, t in zip(matchers, tokens):
                if m is not None and not self.grammars().consume(m, t):
                    log.warning("the grammar matcher refused sampled token %d", t)
            _record_logprobs(seqs, logits, tokens)
            for b, t in zip(rows, tokens):
                sampled[b] = t
        self.scheduler.update(batch, sampled, self.tokenizer.eos_token_ids)
        if self.prefix_cache is not None and batch.is_prefill:
            for seq in batch.seqs:  # a chunk that ended at a snapshot point of its prompt: keep the state
                if not seq.is_finished and self.prefix_cache.is_point(seq, seq.num_cached):
                    self.prefix_cache.store(seq)
        return self._outputs(batch, rows)

    def _outputs(self, batch: Batch, rows: list[int]) -> list[RequestOutput]:
        outputs = []
        for b in rows:
            seq = batch.seqs[b]
            outputs.append(RequestOutput.from_sequence(seq, delta=self._postprocess(seq)))
        return outputs

    def _overlaps(self, batch: Batch, plan: StepPlan) -> bool:
        """Whether `batch`'s step (planned as `plan`, plan.ahead tokens past the recorded state) may be
        launched without waiting: overlap on, a plain one-token decode of every sequence, no log-probabilities
        wanted, and (where overlap is automatic) a step that replays a graph."""
        seqs, ahead = batch.seqs, plan.ahead
        if not self.overlap or not seqs:
            return False
        if batch.is_prefill or any(n != 1 for n in batch.num_new_tokens):
            return False
        for seq in seqs:
            if seq.slot is None or seq.params.logprobs is not None or seq.params.prompt_logprobs is not None:
                return False
            if seq.matcher is not None:  # its token mask is computed on the host before each sample
                return False
            if seq.num_cached != seq.num_tokens - 1:  # exactly one token not in the cache (before `ahead`)
                return False
        if self.config.overlap_decode is None:
            return plan.mode == "decode_graph"
        return all(s.num_cached + ahead + 1 <= self.cache.max_len for s in seqs)

    def _lookahead(self, cur: _InFlight) -> tuple[Batch, StepPlan] | None:
        """The decode step to launch before `cur` is recorded, with its plan: the sequences of `cur` that
        may continue, when the scheduler would run exactly them next (nothing waits for a prefill, no other
        sequence is running). None to drain instead."""
        if not self.overlap or self.scheduler.waiting:
            return None
        live = [s for s in cur.batch.seqs if not s.is_finished]
        if live != self.scheduler.running:
            return None
        limit = self.scheduler.config.max_model_len
        # the sequences that cur's token will certainly end (length limits); EOS and stops are seen later
        seqs = [
            s for s in live if len(s.output_token_ids) + 1 < s.params.max_tokens and s.num_tokens + 1 < limit
        ]
        nxt = Batch(seqs=seqs, num_new_tokens=[1] * len(seqs), is_prefill=False)
        plan = self.runner.plan(nxt, ahead=1)
        return (nxt, plan) if self._overlaps(nxt, plan) else None

    def _launch(self, batch: Batch, plan: StepPlan, prev: _InFlight | None) -> _InFlight:
        """Enqueue a decode step and its sampling; nothing waits for the GPU. Without `prev` the fed tokens
        are the sequences' last recorded ones; with it, `prev`'s sampled tokens (not yet recorded) on the
        device, at positions one further on."""
        seqs = batch.seqs
        if prev is None:
            ids: list[int] | torch.Tensor = batch_ids(batch)
        else:
            row = {id(s): i for i, s in enumerate(prev.batch.seqs)}
            idx = [row[id(s)] for s in seqs]
            if idx == list(range(len(idx))):
                ids = prev.tokens[: len(idx)]
            else:
                dev = prev.tokens.device
                rows = staged(torch.tensor(idx, dtype=torch.int64), dev).to(dev, non_blocking=True)
                ids = prev.tokens.index_select(0, rows)
        logits = self.runner.run(batch, plan, ids).logits
        assert logits is not None
        tokens = self.sampler.sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        if self.config.tp_size > 1:  # rank 0's tokens, on the device, before anything reads them
            import torch.distributed as dist

            dist.broadcast(tokens, src=0)
        if tokens.is_cuda:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            return _InFlight(batch, tokens, host, ready)
        return _InFlight(batch, tokens, tokens, None)

    def _record(self, cur: _InFlight) -> list[RequestOutput]:
        """Wait for `cur`'s tokens, record them and return the outputs; rows of sequences that finished
        (or were aborted) after `cur` was launched are dropped."""
        if cur.ready is not None:
            cur.ready.synchronize()
        tokens = cur.host.tolist()
        rows = [b for b, s in enumerate(cur.batch.seqs) if not s.is_finished]
        batch = Batch([cur.batch.seqs[b] for b in rows], [1] * len(rows), is_prefill=False)
        sampled: list[int | None] = [tokens[b] for b in rows]
        self.scheduler.update(batch, sampled, self.tokenizer.eos_token_ids)
        return self._outputs(batch, list(range(len(rows))))

    @staticmethod
    def _agree(tokens: list[int], device: torch.device) -> list[int]:
        """Tensor parallelism: every rank runs the same schedule on the same all-gathered logits, so the
        samples already agree; rank 0's are broadcast anyway so no rounding can make the ranks diverge."""
        import torch.distributed as dist

        t = torch.tensor(tokens, dtype=torch.int64, device=device)
        dist.broadcast(t, src=0)
        return t.tolist()

    def _postprocess(self, seq: Sequence) -> str:
        """Render the new token, apply stop strings, and return the text that is now safe to stream."""
        stopped_by_token = seq.finish_reason is FinishReason.STOP
        if not stopped_by_token:
            old_len = len(seq.output_text)
            seq.output_text += self.detokenizer.step(seq, flush=seq.is_finished)
            stop = seq.params.stop
            if stop:
                # a new match must end inside the new text, so it starts at most len-1 characters before it
                start = max(0, old_len - max(len(s) for s in stop) + 1)
                hits = [i for i in (seq.output_text.find(s, start) for s in stop) if i >= 0]
                if hits:
                    seq.output_text = seq.output_text[: min(hits)]
                    if seq.is_finished:
                        seq.finish_reason = FinishReason.STOP
                    else:
                        self.scheduler.finish(seq, FinishReason.STOP)
        end = len(seq.output_text)
        if not seq.is_finished and seq.params.stop:
            # hold back what could still turn out to be the start of a stop string
            end = max(seq.num_streamed_chars, end - max(len(s) for s in seq.params.stop) + 1)
        delta = seq.output_text[seq.num_streamed_chars : end]
        seq.num_streamed_chars = end
        return delta


class LLM:
    """`LLM(model_dir).generate(prompts, SamplingParams(...))` and `LLM(model_dir).stream(prompt, ...)`."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        config: EngineConfig | None = None,
    ) -> None:
        from k3run.api import load_model

        tp_size = config.tp_size if config is not None else 1
        rank = 0
        if tp_size > 1:
            import torch.distributed as dist

            if not dist.is_initialized() or dist.get_world_size() != tp_size:
                raise ValueError(
                    f"EngineConfig.tp_size={tp_size} needs an initialised torch.distributed world of that "
                    "size (k3run.distributed.init_distributed() under torchrun)"
                )
            rank = dist.get_rank()
        model = load_model(model_dir, dtype=dtype, device=device, tp_rank=rank, tp_size=tp_size)
        self.engine = LLMEngine(model, load_tokenizer(model_dir), config)

    @classmethod
    def from_model(cls, model: EngineModel, tokenizer: Tokenizer, config: EngineConfig | None = None) -> LLM:
        self = cls.__new__(cls)
        self.engine = LLMEngine(model, tokenizer, config)
        return self

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched; outputs in prompt order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        requests: list[str | list[int]] = list(prompts)
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        ids: list[int] = []
        try:
            for p, sp in zip(requests, plist):
                ids.append(self.engine.add_request(p, sp))
        except ValueError:
            # one bad prompt rejects the call; the ones already queued must not linger in the engine
            for rid in ids:
                self.engine.abort(rid)
            raise
        done: dict[int, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def stream(
        self, prompt: str | list[int], params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield an output per generated token; `delta` is the text to print now. Closing the iterator
        early aborts the request and frees its cache slot."""
        rid = self.engine.add_request(prompt, params)
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id == rid:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.engine.abort(rid)
