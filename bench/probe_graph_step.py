"""Where a replayed decode step's time goes: the GPU time of graph.replay() (CUDA events around it) against
the wall time of the whole engine step (scheduler, input copy, replay, logits copy, sampler, detokenizer),
with graphs on and off, and which kernels fill the replay (torch profiler).

    PYTHONPATH=src python bench/probe_graph_step.py [MODEL_DIR] [--batch-sizes 1,8] [--steps 48]
        [--k3-shaped LAYERS,EXPERTS | --kimi-linear [LAYERS,EXPERTS]] [--eager] [--profile STEPS] [--host N]
    PYTHONPATH=src torchrun --nproc-per-node 2 bench/probe_graph_step.py ...   (tensor parallel, NCCL)

Under torchrun (WORLD_SIZE > 1) every rank builds its shard and runs the engine with tp_size = WORLD_SIZE;
rank 0 prints.

--k3-shaped builds a random model at K3's real layer shapes instead of loading MODEL_DIR (bench/k3_shaped.py:
KDA x3 + MLA per 4 layers, latent MoE in every layer, EXPERTS local routed experts, top-16, k3-mixed
quantization); --kimi-linear builds the random Kimi Linear 48B-A3B NVFP4 of bench/k3_shaped.py (full depth:
27 layers, 256 experts, top-8; LAYERS,EXPERTS cut it; --bf16: every weight bf16, the official checkpoint's
form); the tokenizer still comes from MODEL_DIR.
--eager also times the same steps with graphs off.
--profile prints the replay's kernels, grouped by name, per step, at each batch size; with --trace DIR
also by (name, grid), from its Chrome trace (kept in DIR). --modules charges the kernels of the static step
(run eagerly) to the model's modules. --host N prints the top N host functions of
the graph steps by their own time (cProfile; prefills included).
--prompt-lens 30000x1+2000x7 gives the timed steps' prompts mixed lengths, taken in turn (batch 8: one 30000,
seven 2000; the window follows the longest), for batches whose sequences differ as a server's do; --profile,
--host and --eager take the same prompts.
--uniform-routing replaces the routers' picks by fixed uniform draws per (layer, row): the random models'
own routing collapses onto a few experts (the probe prints the distinct experts a step read).
--compare-overlap also times the graph steps with decode overlap off (EngineConfig.overlap_decode=False;
mode "no-ovl"; "graphs" rows have it on, the default).
--configs 'K3RUN_A=1 K3RUN_B=0;K3RUN_C=16;' times each knob setting (';'-separated, an empty one as shipped)
with its own engine and graphs on the one model, printing "-- setting" before its rows; --repeat N makes N
passes, alternating them. Knobs read only at load (K3RUN_MOE_FUSE_SHARED) keep the process's value; the
--profile / --host / --modules passes use the last setting's engine.
Prints per batch size: wall ms per step, GPU ms per replay, the share of the step the GPU is busy, and
decode tokens/s, with the bandwidth roofline beside them: the bytes a step must read (every weight but the
embedding table, the routed experts counted by the expected number of distinct experts a batch of uniformly
routed tokens touches) over the copy bandwidth measured in the same run. Needs CUDA (and fla-core for KDA
models).
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from k3run.api import load_model
from k3run.distributed import init_distributed, shutdown_distributed
from k3run.engine import LLM, EngineConfig, SamplingParams
from k3run.knobs import Knobs, override_knobs
from k3run.tokenizer import load_tokenizer

DEFAULT = Path(__file__).parents[1] / "assets" / "default-model-k3-mixed"


def _engine(
    model,
    tokenizer,
    sizes: list[int],
    max_len: int,
    graphs: bool,
    tp_size: int = 1,
    overlap: bool | None = None,
):
    cfg = EngineConfig(
        max_num_seqs=max(sizes),
        max_model_len=max_len,
        cuda_graphs=graphs,
        tp_size=tp_size,
        overlap_decode=overlap,
    )
    return LLM.from_model(model, tokenizer, cfg).engine


def _prefill_all(engine) -> None:
    """Step until every request is decode-ready (at most its last prompt token uncached): long prompts
    prefill in chunks over several steps (the scheduler runs prefill steps first), which must not count
    as decode steps."""
    sched = engine.scheduler
    engine.step()
    while sched.waiting or any(s.num_uncached > 1 for s in sched.running):
        engine.step()


def _prompt_lengths(spec: str, prompt_len: int) -> list[int]:
    """--prompt-lens as a list of lengths ("30000x1+2000x7": one 30000, then seven 2000); empty:
    [prompt_len]."""
    if not spec:
        return [prompt_len]
    try:
        parts = [part.split("x") for part in spec.split("+")]
        lens = [int(n) for n, count in parts for _ in range(int(count))]
    except ValueError:
        raise SystemExit(f"--prompt-lens: expected LENxCOUNT parts joined by +, got {spec!r}") from None
    if not lens or min(lens) < 1:
        raise SystemExit(f"--prompt-lens: expected lengths >= 1, got {spec!r}")
    return lens


def _add_prompts(engine, batch: int, lens: list[int], params, g: torch.Generator, vocab: int = 2000) -> None:
    """`batch` random prompts of token ids below `vocab`, the i-th of lens[i % len(lens)] tokens."""
    for i in range(batch):
        engine.add_request(torch.randint(0, vocab, (lens[i % len(lens)],), generator=g).tolist(), params)


def _run(engine, sizes: list[int], steps: int, prompt_len: int | list[int], gpu_ms: list, after=None) -> list:
    """Per batch size: (batch, median wall ms per decode step, median GPU ms per replay); prompt_len may be a
    list of lengths, taken in turn. `gpu_ms` collects (start, end) CUDA event pairs around each replay (read
    after the steps: no sync inside them); after(b) runs once each batch size's steps are done."""
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=steps + 1, temperature=0.8, ignore_eos=True)
    lens = prompt_len if isinstance(prompt_len, list) else [prompt_len]
    rows = []
    for b in sizes:
        _add_prompts(engine, b, lens, params, g)
        _prefill_all(engine)
        torch.cuda.synchronize()
        gpu_ms.clear()
        walls = []
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            walls.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        gpu = statistics.median(a.elapsed_time(b) for a, b in gpu_ms) if gpu_ms else float("nan")
        rows.append((b, statistics.median(walls), gpu))
        if after is not None:
            after(b)
    return rows


def _uniform_routing(model, rows: int, seed: int = 0) -> None:
    """Make every router pick, for the i-th row of a step, a fixed set of top-k distinct experts drawn
    uniformly per (layer, row) (its own logits and weights still computed, the picks replaced): a random
    model's hidden states collapse, so its own routing sends most batches to the same few experts, which
    no trained, load-balanced model does. Device tensors only, so the graphs capture it."""
    from k3run.layers.moe import MoERouter

    g = torch.Generator().manual_seed(seed)
    for mod in model.modules():
        if not isinstance(mod, MoERouter):
            continue
        e, k = mod.weight.shape[0], mod.cfg.top_k
        table = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(rows)])
        table = table.to(mod.weight.device)

        tables = {None: table}  # per appended expert (a fused shared one): built at the first, eager call

        def forward(x, extra=None, orig=mod.forward, tables=tables):
            w, ids = orig(x, extra)
            t = ids.shape[0]
            if extra not in tables:
                tables[extra] = torch.cat([tables[None], torch.full_like(tables[None][:, :1], extra)], 1)
            tab = tables[extra]
            return w, (tab[:t] if t <= tab.shape[0] else ids)

        mod.forward = forward  # type: ignore[method-assign]


def _distinct_experts(dec, model, batch: int, window: int) -> float:
    """The mean number of distinct routed experts a MoE layer reads in the static step of `batch` rows, run
    eagerly on the last step's inputs (the random model's routing is far from uniform, so this, not the
    uniform expectation, is what the step's expert bytes scale with)."""
    from k3run.layers.moe import FusedExperts

    counts: list[int] = []

    def pre(mod, args):  # routed experts only: an appended (fused shared) expert has ids >= num_local
        ids = args[1][:batch]
        counts.append(int(torch.unique(ids[ids < mod.num_local]).numel()))

    handles = [m.register_forward_pre_hook(pre) for m in model.modules() if isinstance(m, FusedExperts)]
    with torch.inference_mode():  # the static step's context keeps the experts on device-only paths
        dec._step(dec.bucket(batch), window)
    for h in handles:
        h.remove()
    return statistics.mean(counts) if counts else float("nan")


def _host_profile(engine, sizes: list[int], steps: int, lens: list[int], top: int) -> None:
    """Where the host's time goes in graph decode steps (cProfile; the GPU waits show up in the calls that
    block on it, e.g. the input copy or .tolist())."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    _run(engine, sizes, steps, lens, [])
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:6000])


def _family(name: str) -> str:
    n = name.lower()
    if "gemv" in n or "nvfp4" in n:
        return "nvfp4 gemv (Gluon)"
    if "e4m3" in n or "fp8" in n or "scaled_mm" in n or "act_quant" in n:
        return "fp8 (quant + gemm)"
    if "gemm" in n or "cutlass" in n or "xmma" in n or "cublas" in n:
        return "cuBLAS bf16/fp32 gemm"
    if "triton" in n or "kda" in n or "fwd_kernel" in n:
        return "triton (fla, conv, other)"
    if "reduce" in n:
        return "reductions"
    return "elementwise / copies / other"


def _step_bytes(model) -> tuple[float, float, int, int]:
    """(bytes of the weights every decode step reads, bytes of one layer's local routed experts on average,
    routed experts per layer, picks per token). The embedding table is left out (a step reads B rows)."""
    from k3run.layers.moe import FusedExperts

    dense = experts = 0.0
    n_moe, top_k = 0, 0
    seen: set[int] = set()
    for name, mod in model.named_modules():
        if isinstance(mod, FusedExperts):
            n_moe += 1
            for t in list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False)):
                if t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    experts += t.numel() * t.element_size()
            continue
        if "embed" in name:
            continue
        for t in list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False)):
            if t.data_ptr() not in seen and t.is_cuda:
                seen.add(t.data_ptr())
                dense += t.numel() * t.element_size()
    for mod in model.modules():
        cfg = getattr(getattr(mod, "gate", None), "cfg", None)
        if cfg is not None and hasattr(cfg, "top_k"):
            top_k = cfg.top_k
            break
    return dense, experts / max(n_moe, 1), n_moe, top_k


def _expected_distinct(model, batch: int) -> tuple[float, int]:
    """(experts one MoE layer reads per step when each token picks top_k of them uniformly, local experts)."""
    from k3run.layers.moe import FusedExperts

    top_k = _step_bytes(model)[3]
    num = next(m.num_local for m in model.modules() if isinstance(m, FusedExperts))
    return (num * (1 - (1 - top_k / num) ** batch) if num else 0.0), num


def roofline_tok_s(model, batch: int, copy_tbs: float) -> float:
    """Decode tokens/s if a step took only its weight reads at the copy bandwidth (TB/s)."""
    dense, per_layer, n_moe, _ = _step_bytes(model)
    distinct, num = _expected_distinct(model, batch)
    step_bytes = dense + n_moe * per_layer * distinct / max(num, 1)
    return batch / (step_bytes / (copy_tbs * 1e12))


def _profile(engine, batch: int, steps: int, lens: list[int], trace: str | None = None) -> None:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=steps + 4, temperature=0.8, ignore_eos=True)
    _add_prompts(engine, batch, lens, params, g)
    _prefill_all(engine)
    engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished():
        engine.step()
    by_name: dict[str, list[float]] = defaultdict(list)
    spans: list[tuple[float, float]] = []
    named: list[tuple[float, float, str]] = []
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            by_name[e.name].append(e.time_range.elapsed_us())
            spans.append((e.time_range.start, e.time_range.end))
            named.append((e.time_range.start, e.time_range.end, e.name))
    total = sum(sum(v) for v in by_name.values()) / steps
    count = sum(len(v) for v in by_name.values()) / steps
    adv = _advance(named)
    fam: dict[str, float] = defaultdict(float)
    fam_adv: dict[str, float] = defaultdict(float)
    for name, ts in by_name.items():
        fam[_family(name)] += sum(ts) / steps
        fam_adv[_family(name)] += adv[name] / steps
    busy, window = _busy(spans)
    print(
        f"\nprofile, batch {batch}, {steps} steps: {total:.0f} us of kernels per step, "
        f"{count:.0f} kernels per step; some kernel running {busy / steps:.0f} us a step, the GPU idle "
        f"{(window - busy) / steps:.0f} us a step between the first kernel and the last "
        f"({busy / window:.1%} busy)"
    )
    print(
        "('us/step' sums each kernel's own span, which under PDL starts while its predecessor still runs; "
        "'advance' charges each instant some kernel runs to the running kernel that ends first, summing to "
        "the busy time)"
    )
    print(f"{'family':<32} {'us/step':>9} {'share':>6} {'advance':>9} {'share':>6}")
    for f, t in sorted(fam.items(), key=lambda kv: -fam_adv[kv[0]]):
        a = fam_adv[f]
        print(f"{f:<32} {t:>9.1f} {t / total:>6.1%} {a:>9.1f} {a / (busy / steps):>6.1%}")
    print(f"{'kernel':<70} {'n/step':>6} {'us/step':>9} {'share':>6} {'advance':>9} {'share':>6}")
    for name, ts in sorted(by_name.items(), key=lambda kv: -adv[kv[0]])[:30]:
        t, a = sum(ts) / steps, adv[name] / steps
        print(
            f"{name[:70]:<70} {len(ts) / steps:>6.1f} {t:>9.1f} {t / total:>6.1%} {a:>9.1f} "
            f"{a / (busy / steps):>6.1%}"
        )
    if trace:
        _launch_table(prof, batch, steps, trace)
    gaps = _gaps(named)
    print(f"idle gaps by (kernel before, kernel after), the largest 16 of {len(gaps)} pairs:")
    print(f"{'before':<48} {'after':<48} {'n/step':>6} {'us/step':>8}")
    for (a, b), (t, n) in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:16]:
        print(f"{a[:48]:<48} {b[:48]:<48} {n / steps:>6.1f} {t / steps:>8.1f}")


def _launch_table(prof, batch: int, steps: int, trace: str) -> None:
    """The profiled steps' kernels by (name, grid) from the exported Chrome trace (the only place the
    profiler keeps each launch's grid): launches a step, us a launch and a step, the largest 30 by time, so
    one launch in the step (say a layer's routed w13) can be set beside its time alone. The trace is kept,
    gzipped, as TRACE/trace_b{batch}.json.gz."""
    import gzip
    import json

    path = Path(trace) / f"trace_b{batch}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text()).get("traceEvents", [])
    with gzip.open(f"{path}.gz", "wb") as f:
        f.write(path.read_bytes())
    path.unlink()
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "kernel":
            args = e.get("args", {})
            groups[(e["name"], str(args.get("grid", "?")))].append(float(e.get("dur", 0.0)))
    print(f"launches by (kernel, grid), batch {batch} (the largest 30 by time a step):")
    print(f"{'kernel':<60} {'grid':<18} {'n/step':>6} {'us each':>8} {'us/step':>8}")
    for (name, grid), ts in sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:30]:
        print(
            f"{name[:60]:<60} {grid[:18]:<18} {len(ts) / steps:>6.1f} {statistics.mean(ts):>8.1f} "
            f"{sum(ts) / steps:>8.1f}"
        )


def _advance(named: list[tuple[float, float, str]]) -> dict[str, float]:
    """Per kernel name, the time it is charged with when every instant some kernel runs goes to the running
    kernel that ends first. Under PDL a kernel starts while its predecessor still runs and waits for it, so
    the overlap is the predecessor's (it ends first); the charges sum to the time some kernel was running."""
    out: dict[str, float] = defaultdict(float)
    order = sorted(range(len(named)), key=lambda i: named[i][0])
    cuts = sorted({t for s, e, _ in named for t in (s, e)})
    active: list[tuple[float, int]] = []
    j = 0
    for lo, hi in zip(cuts, cuts[1:]):
        while j < len(order) and named[order[j]][0] <= lo:
            heapq.heappush(active, (named[order[j]][1], order[j]))
            j += 1
        while active and active[0][0] <= lo:
            heapq.heappop(active)
        if active:
            out[named[active[0][1]][2]] += hi - lo
    return out


def _gaps(named: list[tuple[float, float, str]]) -> dict[tuple[str, str], tuple[float, int]]:
    """The idle time between kernels, by (the kernel whose end left the GPU idle, the kernel that ended the
    idle): (total us, count). Under PDL a launch starts inside its predecessor, so a gap marks a launch that
    could not: a cuBLAS or torch kernel, a join of two streams, or the host."""
    out: dict[tuple[str, str], tuple[float, int]] = {}
    hi, last = None, ""
    for s, e, name in sorted(named):
        if hi is not None and s > hi:
            t, n = out.get((last, name), (0.0, 0))
            out[(last, name)] = (t + s - hi, n + 1)
        if hi is None or e > hi:
            hi, last = e, name
    return out


def _busy(spans: list[tuple[float, float]]) -> tuple[float, float]:
    """(time covered by at least one kernel, first start to last end) of (start, end) spans in us: the idle
    part of the window is the launch gaps that PDL and fewer launches attack."""
    if not spans:
        return 0.0, 1.0
    spans = sorted(spans)
    covered, (lo, hi) = 0.0, spans[0]
    for a, b in spans[1:]:
        if a > hi:
            covered += hi - lo
            lo, hi = a, b
        else:
            hi = max(hi, b)
    covered += hi - lo
    return covered, max(spans[-1][1], hi) - spans[0][0]


def _memory(model, tp) -> None:
    """Per rank: the parameter and buffer bytes it holds, and the CUDA allocator's peak (weights, caches,
    graphs' pools and temporaries) and reserved bytes so far, gathered to rank 0 (issue 23: the measured side
    of `k3run plan`'s per-rank estimate)."""
    seen: set[int] = set()
    held = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_cuda and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            held += t.numel() * t.element_size()
    mine = (tp.rank, held, torch.cuda.max_memory_allocated(), torch.cuda.memory_reserved())
    rows = [mine]
    if tp.size > 1:
        rows = [None] * tp.size
        torch.distributed.all_gather_object(rows, mine)
    print(f"{'rank':>4} {'weights GiB':>12} {'peak allocated GiB':>19} {'reserved GiB':>13}")
    for rank, w, peak, reserved in rows:
        print(f"{rank:>4} {w / 2**30:>12.2f} {peak / 2**30:>19.2f} {reserved / 2**30:>13.2f}")


def _label(name: str, module: torch.nn.Module, model: torch.nn.Module) -> str | None:
    """The module family a static step's time is charged to (nested labels each get their own row)."""
    parts = name.split(".")
    if name == "lm_head":
        return "lm_head"
    if len(parts) < 3 or parts[0] != "layers":
        return None
    layer = model.layers[int(parts[1])]
    kind = type(layer.self_attn).__name__
    rest = ".".join(parts[2:])
    if rest == "self_attn":
        return f"{kind}"
    if rest.startswith("self_attn.") and len(parts) == 4:
        return f"{kind}.{parts[3]}"
    if rest == "mlp":
        return "moe"
    if rest.startswith("mlp.") and len(parts) == 4:
        return f"moe.{parts[3]}"
    if rest.endswith("_res") and len(parts) == 3:
        return "attn_res"
    return None


def _charge(
    ranges: list[tuple[float, float, str]], launches: dict[int, float], kernels: list[tuple[int, float]]
) -> tuple[dict[str, float], dict[str, int], tuple[float, int]]:
    """Kernel time per label, inclusive: each kernel (correlation id, us) goes to every label whose range
    (start, end, label) holds its launch's CPU time (`launches`: correlation id -> time), once per label (a
    module's family counts its submodules' kernels too). Returns (us per label, kernels per label, (us,
    kernels) charged to no label: no launch event, or a launch outside every range)."""
    order = sorted(ranges)
    charged: dict[str, float] = defaultdict(float)
    counted: dict[str, int] = defaultdict(int)
    lost_us, lost_n = 0.0, 0
    timed = sorted((launches[c], us) for c, us in kernels if c in launches)
    for c, us in kernels:
        if c not in launches:
            lost_us += us
            lost_n += 1
    active: list[tuple[float, str]] = []  # (end, label) of the ranges opened so far that may hold t
    nxt = 0
    for t, us in timed:  # one sweep in launch order
        while nxt < len(order) and order[nxt][0] <= t:
            active.append((order[nxt][1], order[nxt][2]))
            nxt += 1
        active = [(end, label) for end, label in active if t < end]
        hit = {label for _, label in active}
        if not hit:
            lost_us += us
            lost_n += 1
        for label in hit:
            charged[label] += us
            counted[label] += 1
    return charged, counted, (lost_us, lost_n)


def _module_profile(dec, model, batch: int, window: int, ctx_len: int, steps: int) -> None:
    """The static step run eagerly (the kernels a replay runs) under the profiler, with each module's
    kernels charged to its family: GPU us per step, summed over the layers."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    labels: dict[str, int] = defaultdict(int)
    handles = []
    for name, module in model.named_modules():
        label = _label(name, module, model)
        if label is None:
            continue
        labels[label] += 1
        ranges: list = []

        def pre(mod, args, label=label, ranges=ranges):
            r = record_function(label)
            r.__enter__()
            ranges.append(r)

        def post(mod, args, out, ranges=ranges):
            ranges.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    dec.inputs[2].fill_(ctx_len)
    with torch.inference_mode():
        dec._step(batch, window)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                dec._step(batch, window)
            torch.cuda.synchronize()
    for h in handles:
        h.remove()
    dec.inputs[2].zero_()
    from torch.autograd import DeviceType

    # Each kernel is charged through its correlation id to the CPU-side call that launched it (a CUDA
    # runtime or driver API event, named cuda* / cu*: cudaLaunchKernel for torch's ops, cuLaunchKernel(Ex)
    # for Triton's), and that call's time to every label range around it. The label events' own kernel
    # lists miss every launch that is not an aten op (all the Triton kernels), so they are not used. Work a
    # module leaves to its consumer (the MoE combine a norm runs) is charged to the consumer.
    ranges, launches, kernels = [], {}, []
    for ev in prof.profiler.kineto_results.events():
        if ev.device_type() == DeviceType.CPU:
            if ev.name() in labels:
                ranges.append((ev.start_ns() / 1e3, ev.end_ns() / 1e3, ev.name()))
            elif ev.name().startswith("cu") and ev.correlation_id():  # not an aten op's own id space
                launches.setdefault(ev.correlation_id(), ev.start_ns() / 1e3)
        elif ev.device_type() == DeviceType.CUDA and ev.name() not in labels:  # not the labels' GPU spans
            kernels.append((ev.correlation_id(), ev.duration_ns() / 1e3))
    charged, counted, (lost_us, lost_n) = _charge(ranges, launches, kernels)
    per_label = {k: v / steps for k, v in charged.items()}
    n_label = {k: v / steps for k, v in counted.items()}
    total = sum(us for _, us in kernels) / steps
    print(
        f"\nmodules, static step run eagerly, batch {batch}, window {window}: {total:.0f} us of kernels, "
        f"{len(kernels) / steps:.0f} kernels per step; outside every module (or with no launch event): "
        f"{lost_us / steps:.0f} us, {lost_n / steps:.0f} kernels"
    )
    print(
        f"{'module family':<40} {'count':>5} {'us/step':>9} {'share':>6} {'kernels/step':>12} "
        f"{'per module':>10}"
    )
    for label in sorted(labels, key=lambda k: -per_label.get(k, 0.0)):
        t = per_label.get(label, float("nan"))
        n = n_label.get(label, 0.0)
        print(
            f"{label:<40} {labels[label]:>5} {t:>9.1f} {t / total:>6.1%} {n:>12.0f} "
            f"{n / labels[label]:>10.1f}"
        )


def _configs(spec: str) -> list[tuple[str | None, dict]]:
    """--configs as (label, Knobs fields to override): "" is one run with the process's knobs (no label)."""
    if not spec:
        return [(None, {})]
    out = []
    for part in spec.split(";"):
        env = dict(os.environ)
        for word in part.split():
            var, _, value = word.partition("=")
            if not var.startswith("K3RUN_") or not value:
                raise SystemExit(f"--configs: expected K3RUN_NAME=value words, got {word!r}")
            env[var] = value
        out.append((part.strip(), dataclasses.asdict(Knobs.from_env(env))))
    return out


def _timed_engine(args, model, tokenizer, sizes: list[int], max_len: int, tp, overlap, copy_tbs: float):
    """One engine with graphs on the model: its rows (and the distinct experts line) printed; returns
    (engine, its graph decoder)."""
    engine = _engine(model, tokenizer, sizes, max_len, graphs=True, tp_size=tp.size, overlap=overlap)
    dec = engine.runner.graphs
    if dec is None:
        raise SystemExit(f"decode runs eagerly: {engine.graph_blocker}")
    with torch.inference_mode():
        dec.warm_up(max(sizes), max_len - 1)
    gpu_ms: list = []
    replay = dec.run

    def timed(ids, slots: list[int], ctx_lens: list[int], replay=replay, gpu_ms=gpu_ms) -> torch.Tensor:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = replay(ids, slots, ctx_lens)
        end.record()
        gpu_ms.append((start, end))
        return out

    dec.run = timed  # type: ignore[method-assign]
    mode = "graphs" if engine.overlap else "no-ovl"
    distinct: dict[int, float] = {}

    def count(b: int, dec=dec, distinct=distinct) -> None:
        distinct[b] = _distinct_experts(dec, model, b, dec.window(max(args.lens) + args.steps))

    for b, wall, gpu in _run(engine, sizes, args.steps, args.lens, gpu_ms, after=count):
        roof = roofline_tok_s(model, b, copy_tbs)
        tok_s = b / wall * 1e3
        print(
            f"{mode:>6} {b:>5} {wall:>13.3f} {gpu:>14.3f} {gpu / wall:>8.0%} {tok_s:>13.1f} {roof:>9.0f} "
            f"{tok_s / roof:>7.1%}"
        )
    dec.run = replay  # type: ignore[method-assign]
    print(
        "distinct routed experts per MoE layer in the last step (uniform routing's expectation): "
        + ", ".join(f"batch {b} {d:.1f} ({_expected_distinct(model, b)[0]:.1f})" for b, d in distinct.items())
    )
    return engine, dec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=str(DEFAULT))
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument(
        "--prompt-lens", default="", metavar="LENxCOUNT+...",
        help="prompts of mixed lengths for the timed steps, taken in turn, e.g. 30000x1+2000x7",
    )  # fmt: skip
    ap.add_argument("--k3-shaped", default=None, metavar="LAYERS,EXPERTS")
    ap.add_argument("--kimi-linear", nargs="?", const="27,256", default=None, metavar="LAYERS,EXPERTS")
    ap.add_argument("--eager", action="store_true", help="also time the steps with graphs off")
    ap.add_argument("--bf16", action="store_true", help="--kimi-linear with every weight bf16 (unquantized)")
    ap.add_argument(
        "--compare-overlap", action="store_true", help="also time graph steps without decode overlap (no-ovl)"
    )
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS")
    ap.add_argument(
        "--trace", default=None, metavar="DIR",
        help="with --profile: keep each batch's Chrome trace in DIR and print its launches by (kernel, grid)",
    )  # fmt: skip
    ap.add_argument("--modules", action="store_true", help="per-module GPU time of the static step")
    ap.add_argument("--host", type=int, default=0, metavar="N", help="cProfile of the graph steps (top N)")
    ap.add_argument(
        "--uniform-routing", action="store_true", help="router picks drawn uniformly per (layer, row)"
    )
    ap.add_argument(
        "--configs", default="", metavar="'K3RUN_A=1 K3RUN_B=0;...'",
        help="knob settings separated by ';' (an empty one: as shipped), each timed with its own engine and "
        "graphs on the one model, in order, --repeat times",
    )  # fmt: skip
    ap.add_argument("--repeat", type=int, default=1, help="passes over --configs (alternated)")
    args = ap.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    tp = init_distributed()  # TPInfo() without torchrun
    if tp.rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (rank 0 prints; the others run the same steps)
    if args.k3_shaped:
        sys.path.insert(0, str(Path(__file__).parent))
        from k3_shaped import random_k3_model

        layers, experts = (int(v) for v in args.k3_shaped.split(","))
        t0 = time.perf_counter()
        model = random_k3_model(layers, experts, device="cuda", tp=tp)
        built = time.perf_counter() - t0
        what = f"K3-shaped random model, {layers} layers, {experts} local experts (built in {built:.0f} s)"
    elif args.kimi_linear:
        sys.path.insert(0, str(Path(__file__).parent))
        from k3_shaped import kimi_linear_48b_config, random_model

        layers, experts = (int(v) for v in args.kimi_linear.split(","))
        t0 = time.perf_counter()
        hf = kimi_linear_48b_config(layers, experts)
        if args.bf16:
            hf.pop("quantization_config")
        model = random_model(hf, device="cuda", tp=tp)
        built = time.perf_counter() - t0
        what = (
            f"Kimi Linear 48B-A3B {'bf16' if args.bf16 else 'NVFP4'} random, {layers} layers, {experts} "
            f"experts (built in {built:.0f} s)"
        )
    else:
        model = load_model(args.model, dtype=torch.bfloat16, device="cuda", tp_rank=tp.rank, tp_size=tp.size)
        what = args.model
    if tp.size > 1:
        what += f", tensor parallel over {tp.size} ranks ({torch.distributed.get_backend()})"
    tokenizer = load_tokenizer(args.model)
    args.lens = _prompt_lengths(args.prompt_lens, args.prompt_len)
    max_len = max(args.lens) + args.steps + 8
    if args.uniform_routing:
        _uniform_routing(model, max(sizes) * max(args.lens))
        what += ", uniform routing"
    print(f"{torch.cuda.get_device_name()}, {what}, {torch.cuda.memory_allocated() / 2**30:.1f} GiB")
    from common import copy_bandwidth

    copy_tbs = copy_bandwidth()
    dense, per_layer, n_moe, top_k = _step_bytes(model)
    print(
        f"copy bandwidth {copy_tbs:.2f} TB/s; weights read per step: {dense / 1e9:.2f} GB dense + {n_moe} x "
        f"{per_layer / 1e9:.3f} GB routed experts (top-{top_k}, counted by the expected distinct experts)"
    )
    head = f"{'mode':>6} {'batch':>5} {'wall ms/step':>13} {'replay GPU ms':>14} {'GPU busy':>9}"
    print(f"{head} {'decode tok/s':>13} {'roofline':>9} {'of roof':>7}")
    engine = dec = None
    overlaps = (None, False) if args.compare_overlap else (None,)
    runs = [(c, o) for c in _configs(args.configs) * args.repeat for o in overlaps]
    for (label, config), overlap in runs:
        if engine is not None:  # free the last engine's graphs and cache first
            engine = dec = None
            torch.cuda.empty_cache()
        if label is not None:
            print(f"-- {label or 'as shipped'}", flush=True)
        with override_knobs(**config):
            engine, dec = _timed_engine(args, model, tokenizer, sizes, max_len, tp, overlap, copy_tbs)
    if args.host:
        _host_profile(engine, sizes, args.steps, args.lens, args.host)
    if args.profile:
        for b in sizes:
            _profile(engine, b, args.profile, args.lens, args.trace)
    if args.modules:
        for b in sizes:
            _module_profile(dec, model, dec.bucket(b), dec.window(args.prompt_len + 1), args.prompt_len, 4)
    _memory(model, tp)
    if args.eager:
        del engine, dec
        torch.cuda.empty_cache()
        engine = _engine(model, tokenizer, sizes, max_len, graphs=False, tp_size=tp.size)
        _run(engine, [1], 4, args.prompt_len, [])  # warm-up
        for b, wall, _ in _run(engine, sizes, args.steps, args.lens, []):
            print(f"{'eager':>6} {b:>5} {wall:>13.3f} {'':>14} {'':>9} {b / wall * 1e3:>13.1f}")
    shutdown_distributed()


if __name__ == "__main__":
    main()
