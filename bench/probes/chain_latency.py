"""Question: what does one dependent link of a decode step cost: a kernel boundary (a plain launch, or a
programmatic dependent launch whose weights are read before its wait, as the NVFP4 GEMVs do) against a
grid-wide barrier inside one persistent kernel, and how much of it does streaming work hide? It sizes the
persistent per-layer design (bench/NOTES.md "Session 54: what fewer, longer-lived kernels would have to
win"): a full-depth Kimi Linear step at batch 8 is ~300 dependent kernels, ~12 us each on average.

A chain of N links. In each stage every one of G programs streams its share of the stage's own weight
words (folded into a value the compiler cannot drop), then reads the value another program wrote in the
stage before, adds 1 and writes its own. After N stages every value is N exactly (checked after each
form), so a stage that read before its producer wrote fails the check.
- plain: N launches, one a stage; each starts when the last has finished.
- pdl: the same launches with programmatic dependent launch: a stage reads its weights, then waits
  (griddepcontrol.wait) and lets the next launch in.
- persist: one launch of G resident programs walking the N stages with a grid-wide barrier between them
  (an arrival counter, released and acquired at GPU scope); each stage's weights are read before its wait.
  G must fit on the GPU at once (the probe refuses more than 4 programs an SM).
- stream: the same weight words in one launch with no dependency: the floor of the work itself.
Prints us a link for each form and, beside them (-s), (form - stream) / N: what a link costs above its
bytes.
Weights rotate over copies that overflow the L2 (bench/common.py's method).

    PYTHONPATH=src python bench/probes/chain_latency.py [--links 64] [--kb 0,1024,4096,16384]
        [--programs 132,264,528] [--warps 4]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
import triton
import triton.language as tl

from k3run.kernels.pdl import pdl_enter

BLOCK = 2048  # int32 words a program reads a step (4 warps: four 16-byte loads a thread in flight)


@triton.jit
def _stream(w_ptr, share, pid, BLOCK: tl.constexpr):
    # the sum (int32, wrapping) of program pid's share of a stage's words at w_ptr: G shares of `share`
    # words, a multiple of BLOCK (so no load is masked and each thread reads whole 16-byte vectors)
    base = pid.to(tl.int64) * share
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(0, share // BLOCK):
        acc += tl.load(w_ptr + base + i * BLOCK + tl.arange(0, BLOCK))
    return tl.sum(acc, axis=0)


# `zero` never becomes a compile-time constant (it would fold the weight reads away), nor `stage` (Triton
# makes an int of 1 one, and a constant has no .to); `share`, a multiple of BLOCK, is specialised as
# divisible by 16 (so the loads are 16-byte vectors)
@triton.jit(do_not_specialize=["stage", "zero"])
def _link_kernel(prev_ptr, out_ptr, w_ptr, stage, share, zero, G, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    acc = _stream(w_ptr + stage.to(tl.int64) * G * share, share, pid, BLOCK)
    pdl_enter(PDL)
    v = tl.load(prev_ptr + (pid + 7) % G)
    tl.store(out_ptr + pid, v + 1 + acc * zero)


@triton.jit(do_not_specialize=["zero"])
def _persist_kernel(buf_ptr, w_ptr, cnt_ptr, N, share, zero, G, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    for s in range(N):
        acc = _stream(w_ptr + s.to(tl.int64) * G * share, share, pid, BLOCK)
        target = s * G  # every program has written stage s - 1's value
        seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
        while seen < target:
            seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
        v = tl.load(buf_ptr + s * G + (pid + 7) % G, cache_modifier=".cg")
        tl.store(buf_ptr + (s + 1) * G + pid, v + 1 + acc * zero)
        tl.debug_barrier()  # every thread's store before the arrival
        tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")


@triton.jit(do_not_specialize=["zero"])
def _floor_kernel(w_ptr, out_ptr, share, zero, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    tl.store(out_ptr + pid, _stream(w_ptr, share, pid, BLOCK) * zero)


def share_for(kb: int, g: int, block: int = BLOCK) -> int:
    """int32 words a program streams a stage for at least kb KB a stage over g programs (whole steps of
    `block` words: a link's bytes are rounded up to g * block * 4)."""
    return -(-kb * 256 // (block * g)) * block


def chain(
    form: str, buf: torch.Tensor, w: torch.Tensor, cnt: torch.Tensor, share: int, warps: int = 4,
    block: int = BLOCK,
):  # fmt: skip
    """The N-link chain in `form` (plain / pdl / persist) over buf [N + 1, G] int32 (row 0 the input): in
    stage s program p streams the `share` int32 words of w at (s * G + p) * share, and the stage writes row
    s + 1 (share a multiple of `block`, the words a program reads a step). cnt: one int32 (persist's arrival
    counter, zeroed here)."""
    n, g = buf.shape[0] - 1, buf.shape[1]
    if form == "persist":
        cnt.zero_()
        _persist_kernel[(g,)](buf, w, cnt, n, share, 0, g, BLOCK=block, num_warps=warps)
        return
    pdl = {"PDL": True, "launch_pdl": True} if form == "pdl" else {"PDL": False}
    for s in range(n):
        _link_kernel[(g,)](buf[s], buf[s + 1], w, s, share, 0, g, BLOCK=block, num_warps=warps, **pdl)


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/ (common)
    ap = argparse.ArgumentParser()
    ap.add_argument("--links", type=int, default=64)
    ap.add_argument(
        "--kb", default="0,1024,4096,16384", help="weight KB a link (all programs; rounded up to G x 8 KB)"
    )
    ap.add_argument("--programs", default="", help="G values (default: 1, 2 and 4 programs an SM)")
    ap.add_argument("--warps", type=int, default=4)
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gs = [int(g) for g in args.programs.split(",")] if args.programs else [sms, 2 * sms, 4 * sms]
    if max(gs) > 4 * sms:
        raise SystemExit(
            f"--programs: at most {4 * sms} (4 an SM), so that every persistent program is resident"
        )
    n = args.links
    print(f"{torch.cuda.get_device_name()}, {sms} SMs, {n} links, {args.warps} warps a program; us a link")
    heads = ("stream", "plain", "pdl", "persist", "plain-s", "pdl-s", "pers-s")
    print(f"{'G':>5} {'KB/link':>8} " + " ".join(f"{h:>8}" for h in heads))
    for g in gs:
        for kb in (int(v) for v in args.kb.split(",")):
            us = {k: 1e3 * v / n for k, v in _row(g, kb, n, args.warps).items()}
            cols = [us[k] for k in ("stream", "plain", "pdl", "persist")]
            cols += [us[k] - us["stream"] for k in ("plain", "pdl", "persist")]
            kb_real = share_for(kb, g) * g // 256
            print(f"{g:>5} {kb_real:>8} " + " ".join(f"{c:>8.2f}" for c in cols), flush=True)


def _row(g: int, kb: int, n: int, warps: int) -> dict[str, float]:
    """ms a call of each form (and the stream floor) for G programs and kb KB of weights a link."""
    from common import copies_for, graph_ms

    share = share_for(kb, g)
    words = max(n * g * share, 1)
    copies = copies_for(4 * words)
    ws = [torch.randint(-(2**30), 2**30, (words,), dtype=torch.int32, device="cuda")
          for _ in range(copies)]  # fmt: skip
    buf = torch.zeros(n + 1, g, dtype=torch.int32, device="cuda")
    cnt = torch.zeros(1, dtype=torch.int32, device="cuda")
    sink = torch.empty(g, dtype=torch.int32, device="cuda")
    row = {}
    for form in ("plain", "pdl", "persist"):
        row[form] = graph_ms([functools.partial(chain, form, buf, w, cnt, share, warps) for w in ws])
        buf[1:].zero_()
        chain(form, buf, ws[0], cnt, share, warps)
        bad = int((buf[n] != n).sum())
        if bad:
            raise SystemExit(f"{form}, G {g}, {kb} KB: {bad} of {g} final values are not {n}")
    launch = _floor_kernel[(g,)]
    row["stream"] = graph_ms(
        [functools.partial(launch, w, sink, n * share, 0, BLOCK=BLOCK, num_warps=warps) for w in ws]
    )
    return row


if __name__ == "__main__":
    main()
