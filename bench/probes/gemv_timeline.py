"""Question: within a launch of the cp.async NVFP4 decode kernel, where does the time beyond streaming go:
program dispatch, the PDL wait, the K loops, the split-K tail, or the gap between launches?

Answer (bench/RESULTS.md "Runs 29-36", runs 29-30; NOTES.md "Session 11"): not dispatch. At 7168^2, M = 1
(10.83 us a launch) all 3584 programs enter within 0.72 us, the K loops spread 5.0 / 6.9 / 8.6 us (min /
median / max: ~2 us of drain), the split-K tail takes 1.25 us, and with PDL the next launch's first program
enters 0.7-0.8 us after this one's last end (1.2-1.4 us without). %globaltimer advances in 32 ns steps.


Each program of the cp.async kernel stamps %globaltimer at entry, after the PDL wait, after its K loop and at
its end, and records its SM (`nvfp4_gemv(stamps=...)`). A CUDA graph of L launches over L2-busting weight
copies is replayed; from the last replay, per launch (averaged over launches 2..L):
- ramp: last program entry - first program entry (how long the dispatch of all programs takes);
- wait: entry -> past griddepcontrol.wait (PDL: how long a program sits on the previous launch);
- loop: the K loop of one program (min / median / max);
- tail: last program end - last K loop end (the split-K reduction and the drain);
- span: first entry -> last end of one launch; period: first entry of one launch -> of the next;
- resident: the most programs of one launch on one SM at once.
First: the update granularity of %globaltimer (one thread reading it in a loop).

    PYTHONPATH=src python bench/probes/gemv_timeline.py [--shapes 7168x7168,...] [--ms 1,16]
"""

# ruff: noqa: B023

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
from common import BYTES_PER_NVFP4_WEIGHT, copies_for, graph_ms  # noqa: E402
from gemv_pdl import VARIANTS, launch, weights  # noqa: E402


@triton.jit
def _timer_kernel(out_ptr, N: tl.constexpr):
    for i in range(N):
        t = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
        tl.store(out_ptr + i, t)


def timer_granularity() -> tuple[int, int]:
    """(smallest, median) positive step between consecutive %globaltimer reads of one thread, ns."""
    out = torch.zeros(4096, dtype=torch.int64, device="cuda")
    _timer_kernel[(1,)](out, N=4096, num_warps=1)
    torch.cuda.synchronize()
    d = out.diff()
    steps = d[d > 0].tolist()
    return min(steps), int(statistics.median(steps))


def programs(n: int, k: int, m: int, **kw) -> int:
    """The grid size of launch(): row blocks x split_k."""
    from k3run.kernels.nvfp4_gemm import choose_config, one_wave_split
    from k3run.kernels.nvfp4_gemm.triton import largest_divisor

    cfg = choose_config(m, n, k)
    split = kw.get("split") or max(1, cfg.split_k * kw.get("split_mul", 1) // kw.get("split_div", 1))
    if kw.get("wave"):
        split = one_wave_split(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)[0]
    split = largest_divisor(-(-k // 128), split)
    return triton.cdiv(n, 16 * kw.get("num_warps", 1)) * split


def resident(st: torch.Tensor) -> int:
    """The most programs of one launch alive on one SM at the same time."""
    best = 0
    for sm in st[:, 4].unique().tolist():
        rows = st[st[:, 4] == sm]
        ev = sorted([(int(a), 1) for a in rows[:, 0]] + [(int(b), -1) for b in rows[:, 3]])
        cur = 0
        for _, e in ev:
            cur += e
            best = max(best, cur)
    return best


def r2(y: torch.Tensor, key: torch.Tensor) -> float:
    """The share of y's variance explained by the group means of key."""
    means = torch.zeros(int(key.max()) + 1, dtype=y.dtype).index_add_(0, key, y) / torch.bincount(key).clamp(
        min=1
    )
    return 1 - float(((y - means[key]) ** 2).sum() / ((y - y.mean()) ** 2).sum())


def spread(s: torch.Tensor, grid_n: int) -> str:
    """What the K-loop time of a program goes with: its SM, its split index, its row block, its entry time,
    the number of programs on its SM."""
    loop = (s[:, 2] - s[:, 1]).double()
    idx = torch.arange(s.shape[0])
    sm = s[:, 4]
    per_sm = torch.bincount(sm)
    entry = (s[:, 0] - s[:, 0].min()).double()
    c = torch.corrcoef(torch.stack([loop, entry]))[0, 1].item()
    counts = per_sm[sm]
    by_count = " ".join(
        f"{int(v)}:{loop[counts == v].mean().item():.0f}" for v in counts.unique() if (counts == v).sum() > 8
    )
    return (
        f"R2 sm {r2(loop, sm):.2f} split {r2(loop, idx // grid_n):.2f} rowblock {r2(loop, idx % grid_n):.2f} "
        f"corr(entry) {c:+.2f} | loop by programs/SM {by_count}"
    )


def timeline(n: int, k: int, m: int, name: str, dump: dict | None = None) -> str:
    wbytes = n * k * BYTES_PER_NVFP4_WEIGHT
    _, pws = weights(n, k, copies_for(wbytes))
    x = torch.randn(m, k, device="cuda").bfloat16()
    kw = VARIANTS[name]
    grid = programs(
        n,
        k,
        m,
        **{a: b for a, b in kw.items() if a in ("num_warps", "split_mul", "split_div", "split", "wave")},
    )
    stamps = [torch.zeros(grid, 5, dtype=torch.int64, device="cuda") for _ in pws]
    ref = launch(x, pws[0], **kw)
    assert torch.equal(launch(x, pws[0], stamps=stamps[0], **kw), ref), "stamps changed the result"
    t_plain = graph_ms([lambda p=p: launch(x, p, **kw) for p in pws], 0.01)
    t_stamp = graph_ms([lambda p=p, s=s: launch(x, p, stamps=s, **kw) for p, s in zip(pws, stamps)], 0.01)
    # the last replay of graph_ms left its stamps: launches in order 0..L-1 (one round of the round-robin)
    st = [s.cpu() for s in stamps]
    if any((s[:, 0] == 0).any() for s in st):
        raise RuntimeError("a program did not stamp")
    rows = []
    for i in range(1, len(st)):
        s, prev = st[i], st[i - 1]
        t0 = s[:, 0].min()
        loop = (s[:, 2] - s[:, 1]).float()
        rows.append(
            dict(
                ramp=(s[:, 0].max() - t0).item(),
                wait=(s[:, 1] - s[:, 0]).float().median().item(),
                loop_min=loop.min().item(),
                loop_med=loop.median().item(),
                loop_max=loop.max().item(),
                last_loop_start=(s[:, 1].max() - t0).item(),
                first_loop_end=(s[:, 2].min() - t0).item(),
                tail=(s[:, 3].max() - s[:, 2].max()).item(),
                span=(s[:, 3].max() - t0).item(),
                period=(t0 - prev[:, 0].min()).item(),
                overlap=(prev[:, 3].max() - t0).item(),
                resident=resident(s),
            )
        )
    avg = {key: statistics.mean(r[key] for r in rows) for key in rows[0]}
    grid_n = triton.cdiv(n, 16 * kw.get("num_warps", 1))
    if dump is not None:
        dump[f"{n}x{k}_m{m}_{name}"] = dict(stamps=torch.stack(st), grid_n=grid_n)
    return (
        f"{n:>5}x{k:<6} M={m:<2} {name:<6} {grid:5d} progs | {t_plain * 1e3:6.2f} us "
        f"({t_stamp * 1e3:6.2f} stamped) | "
        f"ramp {avg['ramp']:5.0f} wait {avg['wait']:5.0f} loop {avg['loop_min']:5.0f}/{avg['loop_med']:5.0f}/"
        f"{avg['loop_max']:5.0f} lastin {avg['last_loop_start']:5.0f} firstout {avg['first_loop_end']:5.0f} "
        f"tail {avg['tail']:5.0f} span {avg['span']:6.0f} period {avg['period']:6.0f} "
        f"overlap {avg['overlap']:5.0f} res {avg['resident']:4.1f}\n    {spread(st[1], grid_n)}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="7168x7168,12288x7168,3072x3584")
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--variants", default="base,nopdl")
    ap.add_argument("--dump", default="", help="torch.save every launch's stamps to this file")
    args = ap.parse_args()
    dump: dict | None = {} if args.dump else None
    torch.manual_seed(0)
    lo, med = timer_granularity()
    print(f"%globaltimer steps: smallest {lo} ns, median {med} ns", flush=True)
    lines = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        for m in (int(v) for v in args.ms.split(",")):
            for name in args.variants.split(","):
                line = timeline(n, k, m, name, dump)
                print(line, flush=True)
                lines.append(line)
    if dump is not None:
        torch.save(dump, args.dump)
    print(f"\n{torch.cuda.get_device_name()}; ns, averaged over launches 2..L of one graph replay")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
