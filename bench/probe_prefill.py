"""Where one prefill goes, per module: torch.profiler over one prompt through the engine, the device time of
the kernels launched inside each module (labelled by forward hooks: the layer kind, KDA / MLA mixer, MoE
router / routed experts / shared experts, norms, AttnRes), the host time and the kernel count beside them.

    PYTHONPATH=src python bench/probe_prefill.py --model kimi-linear --tokens 8192     # GPU, full depth
    PYTHONPATH=src python bench/probe_prefill.py --model tiny --tokens 64 --device cpu  # the logic, on a CPU
    PYTHONPATH=src torchrun --nproc-per-node 8 bench/probe_prefill.py --model kimi-linear --no-profile  # TP 8

`kimi-linear`: the full-depth random Kimi Linear 48B-A3B NVFP4 of bench/k3_shaped.py (27 layers, 256
experts, in memory); `kimi-linear-bf16`: the same in bf16 (the official checkpoint's dtype, 96 GB); `k3`:
the K3-shaped 4-layer slice; `tiny`: the Kimi Linear config cut to 2 layers, 8
experts and small widths (bf16, no quantization: for checking the script itself); a directory: that
checkpoint, loaded (e.g. the full-size one `bench/write_kimi_linear.py` writes).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from k3_shaped import kimi_linear_48b_config, random_k3_model, random_model  # noqa: E402

from k3run.distributed import NO_TP, TPInfo, init_distributed, shutdown_distributed  # noqa: E402
from k3run.engine import LLM, EngineConfig, SamplingParams  # noqa: E402
from k3run.tokenizer import load_tokenizer  # noqa: E402


def build(name: str, device: str, tp: TPInfo = NO_TP):
    if Path(name).is_dir():  # a checkpoint on disk (bench/write_kimi_linear.py writes the full-size one)
        from k3run.api import load_model

        t0 = time.perf_counter()
        model = load_model(name, dtype=torch.bfloat16, device=device, tp_rank=tp.rank, tp_size=tp.size)
        print(f"loaded {name} in {time.perf_counter() - t0:.1f} s")
        return model
    if name == "kimi-linear":
        return random_model(kimi_linear_48b_config(), device=device, tp=tp)
    if name == "kimi-linear-bf16":  # the official checkpoint's form: every weight bf16 (96 GB)
        hf = kimi_linear_48b_config()
        hf.pop("quantization_config")
        return random_model(hf, device=device, tp=tp)
    if name == "k3":
        return random_k3_model(4, 64, device=device, tp=tp)
    hf = kimi_linear_48b_config(layers=2, experts=8)
    hf.pop("quantization_config")
    hf |= {"hidden_size": 256, "moe_intermediate_size": 128, "intermediate_size": 512, "vocab_size": 4096,
           "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 128}  # fmt: skip
    hf["linear_attn_config"]["num_heads"] = 4
    return random_model(hf, device=device, dtype=torch.bfloat16 if device != "cpu" else torch.float32, tp=tp)


def label(name: str) -> str | None:
    """The module's bucket: 'KDA mixer', 'MLA mixer', 'routed experts', ... (None: not a bucket)."""
    rules = [
        (r"\.self_attn$", "mixer"), (r"\.mlp\.experts$", "routed experts"), (r"\.mlp\.gate$", "router"),
        (r"\.mlp\.shared_experts$", "shared experts"), (r"\.mlp$", "MoE / MLP (rest)"),
        (r"(input|post_attention)_layernorm$", "norms"), (r"_res$", "AttnRes"), (r"lm_head$", "lm_head"),
    ]  # fmt: skip
    for pattern, what in rules:
        if re.search(pattern, name):
            return what
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    models = ["kimi-linear", "kimi-linear-bf16", "k3", "tiny"]
    ap.add_argument("--model", default="kimi-linear", help=f"one of {models}, or a checkpoint directory")
    ap.add_argument("--tokens", default="8192", help="prompt lengths, comma-separated (one model build)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeat", type=int, default=3, help="unprofiled timed prefills before the profiled one")
    ap.add_argument("--top", type=int, default=15, help="kernels listed by device time")
    ap.add_argument(
        "--compare-wgmma", action="store_true",
        help="the unprofiled repeats also with the wgmma kernels off (Triton tile GEMM), alternating",
    )  # fmt: skip
    ap.add_argument(
        "--compare-graphs", action="store_true",
        help="the unprofiled repeats also with prefill graphs off (an eager engine), alternating, and the "
        "graph's logits against the eager prefill's",
    )  # fmt: skip
    ap.add_argument("--no-profile", action="store_true", help="only the unprofiled repeats")
    ap.add_argument(
        "--syncs", action="store_true",
        help="one more prefill in torch.cuda sync debug mode: each host synchronisation, by call site",
    )  # fmt: skip
    ap.add_argument("--host", action="store_true", help="one more prefill under cProfile (host functions)")
    ap.add_argument(
        "--host-modules", action="store_true",
        help="one more prefill with perf_counter hooks: the host time spent issuing each module's work",
    )  # fmt: skip
    args = ap.parse_args()
    tp = init_distributed()  # TPInfo() without torchrun; under it every rank runs the same prefills
    if tp.rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (rank 0 prints)
    model = build(args.model, args.device, tp)
    kinds = {
        i: ("KDA" if model.config.is_kda_layer(i) else "MLA") for i in range(model.config.num_hidden_layers)
    }
    tok = load_tokenizer("assets/default-model-k3-mixed")
    lengths = [int(t) for t in args.tokens.split(",")]
    cfg = EngineConfig(
        max_num_seqs=1, max_model_len=max(lengths) + 8, max_num_batched_tokens=max(lengths), tp_size=tp.size
    )
    llm = LLM.from_model(model, tok, cfg)
    pg = llm.engine.runner.prefill_graphs
    print(f"prefill graphs: {pg.sizes if pg else llm.engine.prefill_graph_blocker}")
    eager = None
    if args.compare_graphs:
        eager = LLM.from_model(model, tok, dataclasses.replace(cfg, prefill_graph_tokens=0))
    for n_tok in lengths:
        one(args, model, llm, kinds, n_tok, eager)
    shutdown_distributed()


def sync_sites(llm, prompt, params, n_tok: int) -> None:
    """Every synchronizing CUDA call of one prefill (torch's sync debug mode), grouped by its innermost
    frames in k3run / fla."""
    import traceback
    import warnings

    sites: collections.Counter = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        frames = [
            f"{Path(f.filename).name}:{f.lineno} {f.name}"
            for f in traceback.extract_stack()[:-1]
            if ("k3run" in f.filename or "/fla/" in f.filename)
        ]
        sites[" <- ".join(reversed(frames[-3:])) or f"{filename}:{lineno}"] += 1

    saved = warnings.showwarning
    warnings.showwarning = show
    torch.cuda.synchronize()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode(1)
            llm.generate([prompt], params)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = saved
    print(f"{n_tok}-token prefill: {sum(sites.values())} synchronizing calls at {len(sites)} sites")
    for site, count in sites.most_common(25):
        print(f"  {count:5d}  {site}")


def host_profile(llm, prompt, params, n_tok: int) -> None:
    """cProfile over one prefill: the host's functions by their own time and cumulative time."""
    import cProfile
    import io
    import pstats

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    llm.generate([prompt], params)
    sync()
    prof.disable()
    print(f"{n_tok}-token prefill under cProfile: {(time.perf_counter() - t0) * 1e3:.1f} ms")
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(30)
        lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
        start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
        print(f"-- by {key}")
        print("\n".join(lines[start : start + 31]))


HOST_FNS = [
    ("k3run.kernels.kda.fla", "kda_fla_raw"), ("k3run.kernels.kda.conv", "causal_conv1d_varlen_triton"),
    ("k3run.kernels.nvfp4_gemm", "nvfp4_linear"), ("k3run.kernels.nvfp4_gemm.tile", "expert_blocks"),
    ("k3run.kernels.nvfp4_gemm.wgmma", "nvfp4_wgmma_grouped"),
    ("k3run.kernels.nvfp4_gemm.tile", "nvfp4_tile_gemm_grouped"),
]  # fmt: skip


def host_modules(args, model, llm, kinds, prompt, params, n_tok: int) -> None:
    """Host time per module bucket, by perf_counter in forward hooks (no synchronisation, so no profiler
    inflation). Where the host is the bound (the GPU waits for launches) these are the prefill's costs; the
    time outside the decoder layers is the engine's (scheduling, embedding, sampling, the final sync)."""
    handles, start = [], {}
    rows = collections.defaultdict(lambda: [0.0, 0])
    for name, module in model.named_modules():
        what = label(name)
        m = re.search(r"layers\.(\d+)$", name)
        if m:
            what = f"decoder layer ({kinds[int(m.group(1))]})"
        elif what is None:
            continue
        elif what == "mixer":
            m = re.search(r"layers\.(\d+)\.", name)
            what = f"{kinds[int(m.group(1))]} mixer" if m else what

        def pre(mod, inp):
            start[id(mod)] = time.perf_counter()

        def post(mod, inp, out, what=what):
            r = rows[what]
            r[0] += time.perf_counter() - start.pop(id(mod))
            r[1] += 1

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    import importlib

    saved = []
    for mod_name, fn in HOST_FNS:  # module attributes the product imports at call time: wrappable
        try:
            owner = importlib.import_module(mod_name)
            orig = getattr(owner, fn)
        except (ImportError, AttributeError):
            continue

        def timed(*a, _orig=orig, _what=f"fn {fn}", **kw):
            t = time.perf_counter()
            try:
                return _orig(*a, **kw)
            finally:
                r = rows[_what]
                r[0] += time.perf_counter() - t
                r[1] += 1

        setattr(owner, fn, timed)
        saved.append((owner, fn, orig))
    sync = torch.cuda.synchronize if args.device != "cpu" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    try:
        llm.generate([prompt], params)
        sync()
    finally:
        for owner, fn, orig in saved:
            setattr(owner, fn, orig)
        for h in handles:
            h.remove()
    wall = time.perf_counter() - t0
    layers = sum(v[0] for k, v in rows.items() if k.startswith("decoder layer"))
    print(f"{n_tok}-token prefill with host hooks: {wall * 1e3:.1f} ms wall, decoder layers' host time "
          f"{layers * 1e3:.1f} ms, outside them {(wall - layers) * 1e3:.1f} ms")  # fmt: skip
    print("| module (host time incl. children) | calls | host ms | per call us |")
    print("|---|---|---|---|")
    for what, (t, n) in sorted(rows.items(), key=lambda kv: -kv[1][0]):
        print(f"| {what} | {n} | {t * 1e3:.1f} | {t / n * 1e6:.0f} |")


def graph_logits_check(model, llm, prompt: list[int]) -> None:
    """The prefill graph's logits against an eager prefill of the same prompt, relative RMS."""
    runner, cache = llm.engine.runner, llm.engine.cache
    pg = runner.prefill_graphs
    if pg is None or pg.bucket(len(prompt)) is None:
        return
    slot = cache.allocate()
    try:
        with torch.inference_mode():
            ctx = runner._context([len(prompt)], [0], [slot])
            hidden = model(torch.tensor(prompt, device="cuda"), ctx)
            want = model.compute_logits(hidden[len(prompt) - 1 :]).float()
            got = pg.run(prompt, slot)
        err = ((got - want).pow(2).mean() / want.pow(2).mean()).sqrt().item()
        same = bool((got.argmax(-1) == want.argmax(-1)).all())
        print(
            f"{len(prompt)}-token prefill graph vs eager logits: relative RMS {err:.2e}, same argmax {same}"
        )
    finally:
        cache.free(slot)


def one(args, model, llm, kinds, n_tok: int, eager=None) -> None:
    prompt = torch.randint(10, 2000, (n_tok,), generator=torch.Generator().manual_seed(n_tok)).tolist()
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    import k3run.kernels.nvfp4_gemm as ng

    wgmma_on = ng._WGMMA_OK
    states = [wgmma_on, False] if args.compare_wgmma and wgmma_on else [wgmma_on]
    engines = [("", llm)] + ([(" eager prefill", eager)] if eager is not None else [])
    if eager is not None:
        engines[0] = (" prefill graph", llm)
    for state in states:  # warm-up: compiles (and captures the prefill graph)
        ng._WGMMA_OK = state
        for _, engine in engines:
            engine.generate([prompt], params)
    for i in range(args.repeat):
        for state in states:
            ng._WGMMA_OK = state
            for tag, engine in engines:
                if args.device != "cpu":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                engine.generate([prompt], params)
                if args.device != "cpu":
                    torch.cuda.synchronize()
                wall = time.perf_counter() - t0
                what = tag + ("" if len(states) == 1 else (" wgmma on " if state else " wgmma off"))
                print(
                    f"unprofiled prefill {i}{what}: {wall * 1e3:.1f} ms, {n_tok / wall:.0f} tok/s", flush=True
                )
    ng._WGMMA_OK = wgmma_on
    if eager is not None:
        graph_logits_check(model, llm, prompt)
        llm = eager  # the host probes below: the eager prefill's
    if args.syncs and args.device != "cpu":
        sync_sites(llm, prompt, params, n_tok)
    if args.host:
        host_profile(llm, prompt, params, n_tok)
    if args.host_modules:
        host_modules(args, model, llm, kinds, prompt, params, n_tok)
    if args.no_profile:
        return

    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    handles, live = [], {}
    for name, module in model.named_modules():
        what = label(name)
        if what is None:
            continue
        m = re.search(r"layers\.(\d+)\.", name)
        if what == "mixer":
            what = f"{kinds[int(m.group(1))]} mixer" if m else what
        tag = f"[mod] {what}"

        def pre(mod, inp, tag=tag):
            r = record_function(tag)
            r.__enter__()
            live[id(mod)] = r

        def post(mod, inp, out):
            live.pop(id(mod)).__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device != "cpu" else [])
    if args.device != "cpu":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        llm.generate([prompt], params)
        if args.device != "cpu":
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    for h in handles:
        h.remove()
    rows = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for ev in prof.key_averages():
        if ev.key.startswith("[mod] "):
            r = rows[ev.key[6:]]
            r[0] += ev.cpu_time_total / 1e3
            r[1] += getattr(ev, "device_time_total", getattr(ev, "cuda_time_total", 0.0)) / 1e3
            r[2] += ev.count
    cuda = torch.autograd.DeviceType.CUDA
    # the module labels also appear as device-side ranges: not kernels
    kern = [
        ev
        for ev in prof.key_averages()
        if getattr(ev, "device_type", None) == cuda and not ev.key.startswith("[mod]")
    ]
    kernels = sum(ev.count for ev in kern)
    busy = sum(getattr(ev, "device_time_total", 0.0) for ev in kern) / 1e3
    dev_total = sum(r[1] for r in rows.values()) or 1.0
    print(f"{args.model}, {n_tok}-token prefill on {args.device}: {wall * 1e3:.1f} ms wall (profiled), "
          f"{n_tok / wall:.0f} tok/s; {kernels} kernels, {busy:.1f} ms of kernel time")  # fmt: skip
    print("| module | calls | host ms (incl. children) | device ms | share of the modules' device time |")
    print("|---|---|---|---|---|")
    for what, (cpu, dev, n) in sorted(rows.items(), key=lambda kv: -kv[1][1] or -kv[1][0]):
        print(f"| {what} | {n} | {cpu:.1f} | {dev:.1f} | {dev / dev_total:.0%} |")
    if args.device != "cpu":
        kern.sort(key=lambda ev: -getattr(ev, "device_time_total", 0.0))
        print(f"| kernel (top {args.top} by device time) | calls | device ms |")
        print("|---|---|---|")
        for ev in kern[: args.top]:
            print(f"| {ev.key[:90]} | {ev.count} | {getattr(ev, 'device_time_total', 0.0) / 1e3:.1f} |")


if __name__ == "__main__":
    main()
