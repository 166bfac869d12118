"""Builds the flat batch and ForwardContext for one step and returns the logits that need sampling.

On CUDA, pure decode steps (every sequence one token, no prompt log-probabilities) replay CUDA graphs
(`GraphDecoder`): one per (batch bucket, attention window), captured the first time it is needed; so do
prefills of one fresh prompt of up to 4096 tokens (`PrefillGraphs`, one per token bucket). A graph
removes the host's per-kernel launch cost (~0.1 ms per quantized linear through Triton's launcher), which
otherwise bounds decode speed whatever the kernels do. On the CPU, with EngineConfig.compile_cpu_decode,
the same static step runs compiled by torch.compile (`CompiledCpuDecoder`: Inductor's C++ backend, the whole
step as one graph over a symbolic batch and window), which removes the per-op dispatch that bounds a small
model's CPU decode.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from k3run.engine.cache import CacheManager
from k3run.engine.scheduler import Batch
from k3run.engine.sequence import Sequence
from k3run.forward_context import ForwardContext

log = logging.getLogger(__name__)

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)  # decode batch buckets (a batch pads up to the next one)
MIN_GRAPH_WINDOW = 256  # the smallest attention window; windows double from here up to max_len
DEFAULT_GRAPH_STEP_BYTES = 1 << 30  # a captured step's largest temporaries (the MLA window's copies)
# prefill token buckets of PrefillGraphs (a fresh prompt pads up to the next one); above the largest a
# prefill runs eagerly: from ~8K tokens the GPU, not the host, bounds it
PREFILL_GRAPH_TOKENS = (64, 128, 256, 512, 1024, 2048, 4096)


def staged(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` ready for a non-blocking copy to `device`: in pinned memory when that is a GPU (a pageable
    copy would wait for the GPU; CUDA's caching host allocator keeps the pinned block until the copy ran)."""
    return host.pin_memory() if device.type == "cuda" else host


class CausalLM(Protocol):
    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def step_fits(model: object, batch: int, window: int, max_bytes: int | None) -> bool:
    """Whether a static decode step of `batch` rows and attention window `window` keeps its temporaries
    within `max_bytes` (None: no limit), by the model's own `static_step_bytes` estimate (models without
    one always fit)."""
    estimate = getattr(model, "static_step_bytes", None)
    return max_bytes is None or estimate is None or estimate(batch, window) <= max_bytes


class GraphCaptureError(RuntimeError):
    """Capturing a decode step failed (an operation that cannot be captured, say); the runner then decodes
    eagerly from that step on."""


def all_ranks_ok(ok: bool, tp: object, device: torch.device) -> bool:
    """Whether `ok` holds on every rank of the model's tensor-parallel group (`tp`: a TPInfo; True at once
    without one). Ranks must take the same graph-or-eager decision for every step: a rank that replays a
    graph while another decodes eagerly would pair different collectives and hang."""
    size = getattr(tp, "size", 1)
    if size == 1:
        return ok
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=getattr(tp, "group", None))
    return bool(flag.item())


def warm_and_capture(
    step: Any, device: torch.device, pool: Any
) -> tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None, Exception | None]:
    """One eager run of `step` on a side stream (Triton compiles and autotunes there), then its capture into
    a graph on `pool`; `step`'s ForwardContext is a sync-free one (`ForwardContext.sync_free`), so both take
    the same device-only paths. Returns (graph, output, None), or (None, None, the error) when the capture
    refuses the step (host syncs, pageable copies, ...). The kernels' split-K counters are zeroed after the
    capture (kernels/counters.py: one made during it is zeroed only by this graph's replays)."""
    from k3run.kernels.counters import zero_counters

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool):
            out = step()
    except Exception as e:
        return None, None, e
    finally:
        zero_counters()
    return graph, out, None


class GraphDecoder:
    """Decode steps captured as CUDA graphs, one per (batch bucket, attention window).

    Static inputs: token ids, slots and context lengths live in one [3, B_max] device tensor that each step
    overwrites with one copy; a batch of B sequences pads to the next bucket with rows that feed token 0 at
    position 0 of a scratch slot the decoder holds for its lifetime (so padding never touches a sequence's
    cache). The MLA attention window (ForwardContext.attn_window) is the smallest of 256, 512, ... max_len
    above every sequence's context: a graph attends over at most twice the longest context. A (bucket,
    window) whose step would hold more than `max_step_bytes` of temporaries (the window's fp32 copies grow
    with batch x window) is never captured: such steps run eagerly, over each sequence's real context
    (`accepts`).
    Each graph is captured after one eager warm-up of the same step on a side stream (Triton compiles
    there); a static step's ForwardContext holds fused_experts to its host-sync-free paths in both.
    """

    def __init__(
        self,
        model: CausalLM,
        cache: CacheManager,
        max_batch: int,
        max_step_bytes: int | None = DEFAULT_GRAPH_STEP_BYTES,
    ) -> None:
        self.model = model
        self.max_step_bytes = max_step_bytes
        self.cache = cache
        self.device = torch.device(cache.device)
        self.sizes = [b for b in GRAPH_BATCH_SIZES if b < max_batch] + [
            next((b for b in GRAPH_BATCH_SIZES if b >= max_batch), GRAPH_BATCH_SIZES[-1])
        ]
        self.max_batch = self.sizes[-1]
        self.scratch = cache.allocate()  # padding rows write here
        self.inputs = torch.zeros(3, self.max_batch, dtype=torch.int64, device=self.device)  # ids, slots, ctx
        self.inputs[1] = self.scratch
        self.cu = torch.arange(self.max_batch + 1, dtype=torch.int64, device=self.device)
        self.graphs: dict[tuple[int, int], Any] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None

    def bucket(self, batch: int) -> int | None:
        return next((b for b in self.sizes if b >= batch), None)

    def accepts(self, batch: int, longest: int) -> bool:
        """Whether a decode step of `batch` sequences whose longest context (the new token included) is
        `longest` replays a graph: a bucket holds the batch and the step's temporaries fit."""
        b = self.bucket(batch)
        return b is not None and step_fits(self.model, b, self.window(longest), self.max_step_bytes)

    def window(self, longest: int) -> int:
        """The attention window for a step whose longest context (the new token included) is `longest`."""
        w = MIN_GRAPH_WINDOW
        while w < longest:
            w *= 2
        return min(w, self.cache.max_len)

    def _ctx(self, b: int, w: int) -> ForwardContext:
        return ForwardContext(
            cu_seqlens=self.cu[: b + 1],
            context_lens=self.inputs[2, :b],
            slots=self.inputs[1, :b],
            cache=self.cache.cache,
            attn_window=w,
        )

    def _step(self, b: int, w: int) -> torch.Tensor:
        hidden = self.model.forward(self.inputs[0, :b], self._ctx(b, w))
        return self.model.compute_logits(hidden).float()  # [b, V]

    def _scratch_rows(self) -> None:
        """Every input row feeds token 0 at position 0 of the scratch slot (warm-ups and captures)."""
        self.inputs[0].zero_()
        self.inputs[1].fill_(self.scratch)
        self.inputs[2].zero_()

    def _windows(self, longest: int) -> list[int]:
        """The attention windows of steps whose longest context is 1 .. `longest` tokens, shortest first."""
        windows = [self.window(1)]
        while windows[-1] < self.window(longest):
            windows.append(self.window(2 * windows[-1]))
        return windows

    def _capture(self, b: int, w: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self._scratch_rows()
        graph, out, error = warm_and_capture(lambda: self._step(b, w), self.device, self.pool)
        # under tensor parallelism every rank keeps the graph or none does (a capture records the
        # collectives without running them, so a rank whose capture failed has not left the others waiting)
        if not all_ranks_ok(error is None, getattr(self.model, "tp", None), self.device):
            what = f"{type(error).__name__}: {error}" if error is not None else "it failed on another rank"
            raise GraphCaptureError(
                f"capturing the decode step (batch {b}, attention window {w}) failed: {what}"
            ) from error
        assert graph is not None and out is not None
        log.info("captured the decode step for batch %d, attention window %d", b, w)
        return graph, out

    def warm_up(self, max_batch: int, longest: int) -> int:
        """Capture now every graph that batches of up to `max_batch` sequences with contexts of up to
        `longest` tokens will replay (so no capture lands inside a timed run); returns how many are held."""
        for b in self.sizes:
            for w in self._windows(longest):
                if (b, w) not in self.graphs and step_fits(self.model, b, w, self.max_step_bytes):
                    self.graphs[(b, w)] = self._capture(b, w)
            if b >= max_batch:
                break
        return len(self.graphs)

    def _held(self, n: int, ctx_lens: list[int]) -> tuple[int, Any]:
        """(bucket, held step) for a decode step of n sequences with these contexts; captured now if new."""
        b = self.bucket(n)
        if b is None:
            raise ValueError(
                f"{type(self).__name__}: batch of {n} is over the largest bucket {self.max_batch}"
            )
        key = (b, self.window(max(ctx_lens) + 1))
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)
        return b, self.graphs[key]

    def run(self, ids: list[int] | torch.Tensor, slots: list[int], ctx_lens: list[int]) -> torch.Tensor:
        """Logits [B, V] fp32 of one decode step: sequence i feeds ids[i] at position ctx_lens[i] of slot
        slots[i]. `ids` may be a device tensor (the previous step's sampled tokens, for a step launched
        before the host has read them). Nothing here waits for the GPU: the inputs go up by one
        non-blocking copy from pinned memory (CUDA's caching host allocator keeps that buffer until the copy
        has run), so the host can prepare the next step while this one runs."""
        n = len(slots)
        b, (graph, out) = self._held(n, ctx_lens)
        pad = b - n
        host_ids = [0] * b if isinstance(ids, torch.Tensor) else list(ids) + [0] * pad
        host = torch.tensor([host_ids, slots + [self.scratch] * pad, ctx_lens + [0] * pad], dtype=torch.int64)
        self.inputs[:, :b].copy_(staged(host, self.inputs.device), non_blocking=True)
        if isinstance(ids, torch.Tensor):
            self.inputs[0, :n].copy_(ids)
        graph.replay()
        return out[:n].clone()  # the next replay overwrites `out`


def prefill_buckets(max_tokens: int) -> list[int]:
    """The PREFILL_GRAPH_TOKENS buckets a prefill of up to `max_tokens` tokens may replay."""
    return [t for t in PREFILL_GRAPH_TOKENS if t <= max_tokens]


class PrefillGraphs:
    """Prefills of one fresh sequence as CUDA graphs, one per token bucket (PREFILL_GRAPH_TOKENS up to
    `max_tokens`), captured the first time a bucket is needed.

    A prompt of n tokens pads to the next bucket T: rows n..T-1 feed token 0 as a second, scratch sequence in
    the decoder's scratch slot (ForwardContext.padded_prefill), so the prompt's own states and latents are
    exactly the unpadded step's and the padding never touches its cache. Static inputs: token ids [T_max]
    and one [3] cu_seqlens tensor [0, n, T] on the device, overwritten by one copy a step. Such a prefill of
    2048 tokens issues ~600 Triton launches and ~2000 torch ops eagerly, which bound its speed on the host;
    a replay costs one launch. Costs the padding's compute (up to 2x at a bucket's lower edge) and one
    memory pool holding the largest bucket's temporaries.
    """

    def __init__(self, model: CausalLM, cache: CacheManager, scratch: int, max_tokens: int) -> None:
        self.model = model
        self.cache = cache
        self.device = torch.device(cache.device)
        self.sizes = prefill_buckets(min(max_tokens, cache.max_len))
        self.scratch = scratch
        top = self.sizes[-1] if self.sizes else 0
        self.ids = torch.zeros(top, dtype=torch.int64, device=self.device)
        self.cu = torch.zeros(3, dtype=torch.int64, device=self.device)
        self.slots = torch.tensor([scratch, scratch], dtype=torch.int64, device=self.device)
        self.zeros = torch.zeros(2, dtype=torch.int64, device=self.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def bucket(self, n: int) -> int | None:
        return next((t for t in self.sizes if t >= n), None)

    def _ctx(self, t: int) -> ForwardContext:
        return ForwardContext(
            cu_seqlens=self.cu, context_lens=self.zeros, slots=self.slots, cache=self.cache.cache,
            seqlens_list=[t, 0], padded_prefill=True,
        )  # fmt: skip

    def _step(self, t: int) -> torch.Tensor:
        hidden = self.model.forward(self.ids[:t], self._ctx(t))
        return self.model.compute_logits(hidden.index_select(0, self.cu[1:2] - 1)).float()  # [1, V]

    def _set(self, ids: list[int], slot: int, t: int) -> None:
        n = len(ids)
        host = torch.tensor([*ids, *([0] * (t - n)), 0, n, t, slot], dtype=torch.int64)
        staged_host = staged(host, self.device)
        self.ids[:t].copy_(staged_host[:t], non_blocking=True)
        self.cu.copy_(staged_host[t : t + 3], non_blocking=True)
        self.slots[:1].copy_(staged_host[t + 3 :], non_blocking=True)

    def _capture(self, t: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # warm-up and capture: a prompt of half the bucket in the scratch slot (both sequences non-empty)
        self._set([0] * (t // 2), self.scratch, t)
        graph, out, error = warm_and_capture(lambda: self._step(t), self.device, self.pool)
        if error is not None:
            raise GraphCaptureError(
                f"capturing the prefill of {t} tokens failed: {type(error).__name__}: {error}"
            ) from error
        assert graph is not None and out is not None
        log.info("captured the prefill step for %d tokens", t)
        return graph, out

    def warm_up(self, longest: int) -> int:
        """Capture now every bucket a prompt of up to `longest` tokens replays; returns how many are held."""
        for t in self.sizes:
            if t not in self.graphs:
                self.graphs[t] = self._capture(t)
            if t >= longest:
                break
        return len(self.graphs)

    def run(self, ids: list[int], slot: int) -> torch.Tensor:
        """Logits [1, V] fp32 of the last of `ids`, a fresh sequence's prompt in cache slot `slot`; its states
        and latents land in the slot as an eager prefill's would. Nothing here waits for the GPU."""
        t = self.bucket(len(ids))
        if t is None:
            raise ValueError(f"PrefillGraphs: {len(ids)} tokens is over the largest bucket {self.sizes[-1:]}")
        if t not in self.graphs:
            self.graphs[t] = self._capture(t)
        graph, out = self.graphs[t]
        self._set(ids, slot, t)
        graph.replay()
        return out.clone()  # the next replay overwrites `out`


class CompiledCpuDecoder(GraphDecoder):
    """GraphDecoder's static decode step on the CPU, compiled by torch.compile (Inductor's C++ backend) into
    one graph per path instead of captured. The batch and the attention window become symbolic once a
    second value of each is seen: a batch runs at its own size (no padding rows) and a longer window reuses
    the compiled code. Dynamo compiles again where a layer takes another path for some batch sizes (the
    bundled models: batch 1, batches whose expert picks are fewer than the experts, and larger ones), each
    ~30-60 s on 2 cores the first time (Inductor keeps them on disk for later runs), so it is opt-in
    (EngineConfig.compile_cpu_decode, `--compile`) and `warm_up` compiles every path before serving. The
    layers take their sync-free paths while compiling (the dense or picked experts, no host reads). The
    compiled step computes the same operations in a fused order: its logits match the eager step's to the
    activation dtype's rounding (where FP8_PB_WO layers quantize their inputs to fp8, a re-associated input
    can also land one fp8 step apart)."""

    cpp_wrapper = False  # Inductor's C++ wrapper (EngineConfig.compile_cpu_cpp_wrapper)
    compiles = 0  # calls that compiled (a new path); `warm_up` returns it
    _fn: Callable[[int, int], torch.Tensor] | None = None  # the compiled step, made on first use

    def _compiled(self) -> Callable[[int, int], torch.Tensor]:
        if self._fn is not None:
            return self._fn
        from k3run.engine.inductor_passes import SmallMmAsReduction

        self._scratch_rows()
        self._step(1, self.window(1))  # eager first: fills the layers' CPU caches, checks the inputs once
        # a compiled path per batch-size regime: room for many before Dynamo would fall back to eager
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # no guards on the model's modules: checking them costs ~0.3-0.6 ms a step (thousands of attributes),
        # and nothing reassigns a module attribute once the engine runs (the caches change in place)
        options: dict[str, str | int | bool | Callable[..., Any]] = {
            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
            "post_grad_custom_post_pass": SmallMmAsReduction(),  # decode GEMVs as Inductor loops
            # keep pointwise chains of more than 8 ops as buffers instead of inlining them into every
            # consumer: the FP8_PB_WO layers' activation rounding (amax, scale, e4m3 round trip) is
            # otherwise recomputed inside the GEMV loops for every output column (the k3-mixed bundled
            # model's step runs 2.3x faster with 8 than with Inductor's CPU default of 50; the bf16-weights
            # model's is the same with either)
            "realize_opcount_threshold": 8,
            "cpp_wrapper": self.cpp_wrapper,
        }
        # automatic dynamic shapes: a path compiles for the first batch and window it sees and once more, with
        # the changed one symbolic, when another comes (dynamic=True would make the weights' and caches'
        # shapes symbolic too: a batch-1 step of the bundled model runs ~30% slower so)
        self._fn = torch.compile(self._step, fullgraph=True, options=options)
        return self._fn

    def _call(self, b: int, w: int) -> torch.Tensor:
        from torch._dynamo.utils import counters

        fn = self._compiled()
        frames, t0 = counters["stats"]["unique_graphs"], time.perf_counter()
        try:
            out = fn(b, w)
        except Exception as e:  # a graph break, or no C++ compiler for Inductor
            raise GraphCaptureError(
                f"compiling the decode step (batch {b}, attention window {w}) failed: {type(e).__name__}: {e}"
            ) from e
        if counters["stats"]["unique_graphs"] != frames:  # Dynamo traced the step again: a new path
            self.compiles += 1
            log.info("compiled the CPU decode step's path for batch %d, attention window %d in %.1f s", b, w,
                     time.perf_counter() - t0)  # fmt: skip
        return out

    def warm_up(self, max_batch: int, longest: int) -> int:
        """Compile now every path that batches of up to `max_batch` sequences with contexts of up to
        `longest` tokens take; returns how many calls compiled. One step at batch 1 over the windows' first
        two (for a server, max_batch > 1, always two: then the window is symbolic in every later path and
        longer contexts compile nothing), one at each batch size, then the largest batch at each window; a
        step that reuses a compiled path costs milliseconds."""
        windows = self._windows(max(longest, self.window(1) + 1) if max_batch > 1 else longest)
        top = min(max_batch, self.max_batch)
        self._scratch_rows()
        calls = [(1, w) for w in windows[:2]] + [(b, windows[0]) for b in range(2, top + 1)]
        for b, w in calls + [(top, w) for w in windows[1:]]:
            if step_fits(self.model, b, w, self.max_step_bytes):
                self._call(b, w)
        return self.compiles

    def run(self, ids: list[int] | torch.Tensor, slots: list[int], ctx_lens: list[int]) -> torch.Tensor:
        n = len(slots)
        if self.bucket(n) is None:
            raise ValueError(
                f"{type(self).__name__}: batch of {n} is over the largest bucket {self.max_batch}"
            )
        self._compiled()  # before the inputs are written: its eager warm-up step overwrites them
        host_ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        self.inputs[:, :n].copy_(torch.tensor([host_ids, slots, ctx_lens]))
        return self._call(n, self.window(max(ctx_lens) + 1))[:n]


@dataclass(frozen=True)
class StepPlan:
    """How one step runs, decided once per step by `ModelRunner.plan` and followed by `run` (and by the
    engine's decode-overlap choice):
    - "decode_graph": every sequence feeds one token, none wants prompt log-probabilities, and the decode
      graphs (CUDA graphs, or the compiled CPU step) take the batch at its context lengths;
    - "prefill_graph": one fresh prompt whose length a prefill graph bucket holds;
    - "eager": one forward.
    `ahead`: the step's tokens sit this many positions past the sequences' recorded state (1 for a decode step
    launched before the previous step's tokens are recorded)."""

    mode: Literal["decode_graph", "prefill_graph", "eager"]
    ahead: int = 0


@dataclass
class StepOutput:
    """What one `ModelRunner.run` step gives back: the batch rows that end their known tokens, those rows'
    logits [B', vocab] fp32 (None without such rows), and for the rows that asked for prompt log-probabilities
    and fed prompt tokens, the logits of every position they fed ([n_b, vocab] fp32, by batch row)."""

    rows: list[int]
    logits: torch.Tensor | None
    prompt_logits: dict[int, torch.Tensor] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self, model: CausalLM, cache: CacheManager, graphs: GraphDecoder | None = None,
        prefill_graphs: PrefillGraphs | None = None,
    ) -> None:  # fmt: skip
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.graphs = graphs
        self.prefill_graphs = prefill_graphs
        self.graph_error: str | None = None  # why graphs were turned off after a failed capture
        self.prefill_graph_error: str | None = None

    def prepare(self, batch: Batch) -> tuple[torch.Tensor, ForwardContext]:
        ids: list[int] = []
        seqlens: list[int] = []
        ctx_lens: list[int] = []
        slots: list[int] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            slot = _slot(seq)
            if seq.num_cached + n > self.cache.max_len:
                raise RuntimeError(
                    f"sequence {seq.seq_id} would reach {seq.num_cached + n} tokens; the cache holds "
                    f"{self.cache.max_len}"
                )
            ids.extend(seq.all_token_ids[seq.num_cached : seq.num_cached + n])
            seqlens.append(n)
            ctx_lens.append(seq.num_cached)
            slots.append(slot)
        return torch.tensor(ids, dtype=torch.int64, device=self.device), self._context(
            seqlens, ctx_lens, slots
        )

    def _context(self, seqlens: list[int], ctx_lens: list[int], slots: list[int]) -> ForwardContext:
        cu = [0]
        for n in seqlens:
            cu.append(cu[-1] + n)
        dev = self.device
        return ForwardContext(
            cu_seqlens=torch.tensor(cu, dtype=torch.int64, device=dev),
            context_lens=torch.tensor(ctx_lens, dtype=torch.int64, device=dev),
            slots=torch.tensor(slots, dtype=torch.int64, device=dev),
            cache=self.cache.cache,
            seqlens_list=seqlens,
            context_lens_list=ctx_lens,
            slots_list=list(slots),
        )

    def disable_graphs(self, why: str) -> None:
        """Decode eagerly from now on (the graphs' scratch slot stays reserved)."""
        log.warning("decode runs eagerly from now on: %s", why)
        self.graphs = None
        self.graph_error = why

    def disable_prefill_graphs(self, why: str) -> None:
        log.warning("prefills run eagerly from now on: %s", why)
        self.prefill_graphs = None
        self.prefill_graph_error = why

    def warm_up_graphs(self, max_batch: int, longest: int, prompt: int = 0) -> None:
        """Capture the decode graphs for batches of up to max_batch and contexts of up to `longest` tokens,
        and the prefill graphs for prompts of up to `prompt` tokens, now (no-op without graphs; a capture
        failure turns them off, as in `run`)."""
        if self.graphs is not None:
            try:
                with torch.inference_mode():
                    self.graphs.warm_up(max_batch, longest)
            except GraphCaptureError as e:
                self.disable_graphs(str(e))
        if self.prefill_graphs is not None and prompt > 1:
            try:
                with torch.inference_mode():
                    self.prefill_graphs.warm_up(prompt)
            except GraphCaptureError as e:
                self.disable_prefill_graphs(str(e))

    def _prefill_graph_step(self, batch: Batch) -> bool:
        """Whether this step replays a prefill graph: one fresh sequence (nothing cached) feeding 2 or more
        tokens that a bucket holds, no prompt log-probabilities wanted."""
        if self.prefill_graphs is None or len(batch.seqs) != 1:
            return False
        seq, n = batch.seqs[0], batch.num_new_tokens[0]
        if seq.slot is None or seq.num_cached != 0 or n < 2 or seq.params.prompt_logprobs is not None:
            return False
        return self.prefill_graphs.bucket(n) is not None

    def plan(self, batch: Batch, ahead: int = 0) -> StepPlan:
        """The one place a step's way of running is decided (StepPlan): a decode graph where graphs are on,
        every sequence feeds one token (a slot, room in the cache), no prompt log-probabilities are wanted,
        and the decoder accepts the batch at its context lengths (a bucket holds it, the temporaries fit its
        limit); else a prefill graph for one fresh prompt a bucket holds; else eager."""
        one_token = all(n == 1 for n in batch.num_new_tokens)
        prompt_rows = any(
            s.params.prompt_logprobs is not None and s.num_cached < len(s.prompt_token_ids)
            for s in batch.seqs
        )
        if one_token and not prompt_rows and self.graph_decodes(batch.seqs, ahead):
            return StepPlan("decode_graph", ahead)
        if ahead == 0 and self._prefill_graph_step(batch):
            return StepPlan("prefill_graph")
        return StepPlan("eager", ahead)

    def graph_decodes(self, seqs: list[Sequence], ahead: int = 0) -> bool:
        """Whether a one-token decode step of `seqs`, `ahead` tokens past their recorded state (a step
        launched before the previous one's tokens are recorded: ahead = 1), replays a graph."""
        if self.graphs is None or not seqs:
            return False
        for seq in seqs:
            if seq.slot is None or seq.num_cached + ahead + 1 > self.cache.max_len:
                return False
        return self.graphs.accepts(len(seqs), max(s.num_cached for s in seqs) + ahead + 1)

    def _decode(self, seqs: list[Sequence], ids: list[int] | torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """Logits [B, V] fp32 of a one-token decode step of `seqs`, plan.ahead tokens past their recorded
        state, feeding ids[i] (a host list or a device tensor) at position num_cached + ahead: a graph replay
        where the plan says so (and graphs are still on), else one eager forward. A failed capture turns
        graphs off and runs eagerly."""
        slots = [_slot(s) for s in seqs]
        ctx_lens = [s.num_cached + plan.ahead for s in seqs]
        if plan.mode == "decode_graph" and self.graphs is not None:
            try:
                return self.graphs.run(ids, slots, ctx_lens)
            except GraphCaptureError as e:
                self.disable_graphs(str(e))
        if isinstance(ids, torch.Tensor):
            input_ids = ids.to(self.device)
        else:
            input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        ctx = self._context([1] * len(seqs), list(ctx_lens), slots)
        return self.model.compute_logits(self.model.forward(input_ids, ctx)).float()

    @torch.inference_mode()
    def run(
        self, batch: Batch, plan: StepPlan | None = None, ids: list[int] | torch.Tensor | None = None
    ) -> StepOutput:
        """One step as `plan` (default: `self.plan(batch)`) says: a decode or prefill graph replay, or one
        eager forward. `ids`: a one-token decode step's fed tokens when they are not the sequences' recorded
        ones (decode overlap: the previous step's samples, still on the device, plan.ahead = 1); every row
        then samples."""
        plan = plan or self.plan(batch)
        fed = ids is not None or plan.ahead > 0
        if fed and (plan.mode == "prefill_graph" or any(n != 1 for n in batch.num_new_tokens)):
            raise ValueError("run: fed ids and steps ahead of the recorded tokens are one-token decode steps")
        if fed or plan.mode == "decode_graph":  # (a failed capture: `_decode` turns graphs off, runs eagerly)
            return self._run_decode(batch, plan, ids, fed)
        if plan.mode == "prefill_graph" and self.prefill_graphs is not None:
            out = self._run_prefill_graph(batch)
            if out is not None:
                return out
        return self._run_eager(batch)

    def _run_decode(
        self, batch: Batch, plan: StepPlan, ids: list[int] | torch.Tensor | None, fed: bool
    ) -> StepOutput:
        seqs = batch.seqs
        logits = self._decode(seqs, batch_ids(batch) if ids is None else ids, plan)
        rows = [b for b in range(len(seqs)) if fed or batch.samples(b)]
        if not rows:
            return StepOutput(rows, None)
        if len(rows) < len(seqs):
            logits = logits[torch.tensor(rows, device=logits.device)]
        return StepOutput(rows, logits)

    def _run_prefill_graph(self, batch: Batch) -> StepOutput | None:
        """The prefill graph's step; None when its capture failed (prefill graphs are then off)."""
        assert self.prefill_graphs is not None
        seq = batch.seqs[0]
        try:
            logits = self.prefill_graphs.run(seq.all_token_ids[: batch.num_new_tokens[0]], _slot(seq))
        except GraphCaptureError as e:
            self.disable_prefill_graphs(str(e))
            return None
        return StepOutput([0], logits) if batch.samples(0) else StepOutput([], None)

    def _run_eager(self, batch: Batch) -> StepOutput:
        input_ids, ctx = self.prepare(batch)
        hidden = self.model.forward(input_ids, ctx)  # [T, D]
        prompt_logits = {}
        lo = 0
        for b, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if seq.params.prompt_logprobs is not None and seq.num_cached < len(seq.prompt_token_ids):
                prompt_logits[b] = self.model.compute_logits(hidden[lo : lo + n]).float()
            lo += n
        rows = [b for b in range(len(batch.seqs)) if batch.samples(b)]
        if not rows:
            return StepOutput(rows, None, prompt_logits)
        last = ctx.cu_seqlens[1:] - 1  # [B]
        pick = last[torch.tensor(rows, device=last.device)]
        logits = self.model.compute_logits(hidden.index_select(0, pick)).float()
        return StepOutput(rows, logits, prompt_logits)


def batch_ids(batch: Batch) -> list[int]:
    """The token each sequence of a one-token decode step feeds: its first one not in the cache."""
    return [s.all_token_ids[s.num_cached] for s in batch.seqs]


def _slot(seq: Sequence) -> int:
    """The cache slot of a scheduled sequence (the scheduler gives every one it schedules a slot)."""
    if seq.slot is None:
        raise RuntimeError(f"sequence {seq.seq_id} is scheduled without a cache slot")
    return seq.slot
