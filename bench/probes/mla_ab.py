"""Question: is this tree's MLA decode launch faster than another version's, case by case? Times the engine's
launch (`mla_decode_triton` at `decode_config`) of this tree against the same function loaded from another
copy of `kernels/mla/triton.py` (--base, e.g. `git show 0c89699:src/k3run/kernels/mla/triton.py > base.py`),
and this tree's launch at each --chunks value of `min_chunk` (0: the shipped rule), us per call in a CUDA
graph, same process; "err" is the largest relative RMS between this tree's forms and the base. Random bf16
latents, every sequence at the given context in the graph decoder's window. Run 232-233's tables (bench/
RESULTS.md) came from this script:

    PYTHONPATH=src python3 bench/probes/mla_ab.py --base base.py [--chunks 0,64,256,512] [--heads 32,96]
        [--contexts 1024,8192,32768,131072] [--batches 1,8,32] [--mixed 30000x1+2000x7] [--shared]

--shared adds two columns: this tree's launch with each split layout forced, shared=False (a fixed grid per
sequence) and shared=True (the splits shared among a batch's sequences by length); the "0" column takes the
one `shares_splits` picks. --mixed adds batches whose sequences differ in length (CONTEXTxCOUNT parts
joined by +; the window from the longest; labelled longest+(count-1)xshortest).
"""

# every closure below is timed immediately inside its loop iteration, so late binding is harmless
# ruff: noqa: B023

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch


def main() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from bench_mla_decode import _window
    from common import copy_bandwidth, graph_ms

    from k3run.kernels.mla.triton import mla_decode_triton
    from k3run.testing import rel_rms_error

    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="another version of kernels/mla/triton.py")
    ap.add_argument("--chunks", default="0,64,256,512")
    ap.add_argument("--heads", default="32,96")
    ap.add_argument("--contexts", default="1024,8192,32768,131072")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--shared", action="store_true", help="also each split layout, forced")
    ap.add_argument("--mixed", default="", help="mixed-context batches, e.g. 30000x1+2000x7,8000x1+500x31")
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("mla_base", args.base)
    assert spec is not None and spec.loader is not None
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    chunks = ints(args.chunks)
    L, R = 512, 64
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bw:.2f} TB/s")
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = [(b, [ctx] * b) for b in ints(args.batches) for ctx in ints(args.contexts)]
    for spec in (m for m in args.mixed.split(",") if m):  # "30000x1+2000x7": one 30000, seven 2000
        parts = [part.split("x") for part in spec.split("+")]
        lens_list = [int(ctx) for ctx, count in parts for _ in range(int(count))]
        cases.append((len(lens_list), lens_list))
    for h in ints(args.heads):
        listed = " / ".join(map(str, chunks))
        print(f"\n{h} heads, us: base, then this tree at min_chunk {listed} (0: the rule)")
        cols = " ".join(f"{c:>8}" for c in chunks) + (f" {'split':>8} {'shared':>8}" if args.shared else "")
        print(f"{'B':>3} {'ctx':>14} {'bytes us':>8} {'base':>8} {cols}  err")
        for b, ctxs in cases:
            w = _window(max(ctxs))
            store = torch.randn(b, w, L + R, device="cuda", generator=g).to(torch.bfloat16)
            slots = torch.randperm(b, device="cuda", generator=g)
            lens = torch.tensor(ctxs, dtype=torch.int64, device="cuda")
            q_lat = torch.randn(b, h, L, device="cuda", generator=g) / L**0.5
            q_pe = torch.randn(b, h, R, device="cuda", generator=g) / R**0.5
            a = (q_lat, q_pe, store, slots, lens, w, 1.0 / (128 + R) ** 0.5)

            def ours(c: int):
                return mla_decode_triton(*a, min_chunk=c or None)

            t_base = graph_ms([lambda: base.mla_decode_triton(*a)]) * 1e3
            ts = [graph_ms([lambda c=c: ours(c)]) * 1e3 for c in chunks]
            ref = base.mla_decode_triton(*a)
            err = max(rel_rms_error(ref, ours(c)) for c in chunks)
            for layout in (False, True) if args.shared else ():
                ts.append(graph_ms([lambda: mla_decode_triton(*a, shared=layout)]) * 1e3)
                err = max(err, rel_rms_error(ref, mla_decode_triton(*a, shared=layout)))
            floor = sum(n + 1 for n in ctxs) * (L + R) * 2 / bw / 1e6
            times = " ".join(f"{t:>8.1f}" for t in ts)
            label = str(ctxs[0]) if len(set(ctxs)) == 1 else f"{max(ctxs)}+{len(ctxs) - 1}x{min(ctxs)}"
            print(f"{b:>3} {label:>14} {floor:>8.1f} {t_base:>8.1f} {times}  {err:.1e}", flush=True)
            del store
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
