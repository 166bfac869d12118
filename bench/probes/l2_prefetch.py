"""Does prefetching the next layers' dense weights into L2 from a side stream shorten a batch-1 GEMV chain?

At batch 1 the decode step's NVFP4 GEMVs run at ~25% of what their bytes take at the copy bandwidth
(bench/NOTES.md, session 37): most matrices are too small for a launch to ramp to full bandwidth. This probe
builds a chain shaped like Kimi Linear's KDA layers at one token, every layer's weights distinct (the chain
far larger than the L2):
    x [1, 2304] -> in_proj 12448x2304 -> f_b 4096x128 (on 128 of its columns) -> o_proj 2304x4096
    x -> "experts" 16384x2304 (21 MB: eight routed experts' bytes, streaming through the L2)
    next x = o_proj's output + the first 2304 columns of the other two
and times it as one CUDA graph replay, plain and with a side stream that, at each layer's start, prefetches
the dense weights and scales of layer i + AHEAD (kernels/prefetch.py: `cp.async.bulk.prefetch.L2`, one
launch a layer),
joined at the chain's end. Prints us per layer for each, their ratio, and the dense bytes' time at the copy
bandwidth. Needs an sm_90 GPU.

    python3 bench/probes/l2_prefetch.py [--layers 27] [--ahead 1,2] [--repeat 5]

The weights are random bytes with one valid E4M3 scale (no quantization pass: the timing does not depend on
the values); the outputs are not checked.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from k3run.kernels.nvfp4_gemm import nvfp4_linear, prepare_nvfp4_weight
from k3run.kernels.prefetch import PrefetchTable, prefetch_l2

sys.path.insert(0, str(Path(__file__).parents[1]))
from common import copy_bandwidth  # noqa: E402

D, P, K_HEAD, N_IN, N_EXPERTS = 2304, 4096, 128, 12448, 16384


def _weight(n: int, k: int, g: torch.Generator):
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=g)
    s = torch.full((n, k // 16), 0.5, device="cuda").to(torch.float8_e4m3fn)
    return prepare_nvfp4_weight(w, s, torch.tensor(1.0 / k, device="cuda"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--ahead", default="1,2", help="layers ahead to prefetch, one run each")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = [
        dict(
            inp=_weight(N_IN, D, g), fb=_weight(P, K_HEAD, g), o=_weight(D, P, g), ex=_weight(N_EXPERTS, D, g)
        )
        for _ in range(args.layers)
    ]
    dense = [
        PrefetchTable([t for k in ("inp", "fb", "o") for t in (lay[k].weight, lay[k].scale_bits)])
        for lay in layers
    ]
    dense_bytes = sum(table.nbytes for table in dense)
    x0 = torch.randn(1, D, device="cuda", dtype=torch.bfloat16)
    main_s, side = torch.cuda.current_stream(), torch.cuda.Stream()

    def chain(ahead: int) -> torch.Tensor:
        x = x0
        if ahead:
            side.wait_stream(main_s)
            with torch.cuda.stream(side):  # the first layers' weights before the chain starts
                for table in dense[:ahead]:
                    prefetch_l2(table)
        for i, lay in enumerate(layers):
            if ahead and i + ahead < len(layers):
                side.wait_stream(main_s)
                with torch.cuda.stream(side):
                    prefetch_l2(dense[i + ahead])
            y = nvfp4_linear(x, lay["inp"])
            f = nvfp4_linear(y[:, P : P + K_HEAD], lay["fb"])
            o = nvfp4_linear(y[:, :P], lay["o"])
            e = nvfp4_linear(x, lay["ex"])
            x = o + e[:, :D] + f[:, :D]
        if ahead:
            main_s.wait_stream(side)
        return x

    def timed(ahead: int) -> float:
        chain(ahead)  # compiles, warms up
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain(ahead)
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / args.layers)
        return statistics.median(times)

    tbs = copy_bandwidth()
    per_layer = dense_bytes / args.layers
    print(
        f"{torch.cuda.get_device_name()}, copy {tbs:.2f} TB/s, {args.layers} layers, dense "
        f"{per_layer / 1e6:.1f} MB a layer ({per_layer / tbs / 1e6:.2f} us at the copy bandwidth), experts "
        f"{N_EXPERTS * D * 0.5625 / 1e6:.1f} MB a layer"
    )
    plain = timed(0)
    print(f"plain chain: {plain:.2f} us a layer")
    for ahead in (int(v) for v in args.ahead.split(",")):
        t = timed(ahead)
        print(f"prefetch {ahead} layer(s) ahead: {t:.2f} us a layer ({plain / t:.3f}x the plain chain)")
    print(f"plain chain again: {timed(0):.2f} us a layer")


if __name__ == "__main__":
    main()
