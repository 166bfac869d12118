"""KDA on one GPU: fla-core's chunk_kda (prefill) and fused_recurrent_kda (decode) at K3 shapes.

K3 per KDA layer: H = 96 heads, K = V = 128, fp32 recurrent state [B, H, K, V] (6.3 MB per sequence).
Rows:
- chunk, T = 8192 (one sequence and 4 x 2048 varlen): kda_forward with K3's options (lower-bound gate,
  beta sigmoid and q/k L2 norm in the kernel), and the same through chunk_kda with pre-activated inputs.
- recurrent decode, B = 1 / 16 / 64 sequences of one token each: state traffic (read + write of the fp32
  states) in TB/s and as % of the device copy bandwidth measured in the same run.
Each row also times the fp32 torch reference on the same GPU (skip with --no-ref) and prints the relative
RMS error of the kernel against it.

Timing: common.eager_ms (back-to-back eager calls, L2 flushed before each, median): fla's chunk path reads
sequence lengths back to the host, so it cannot be captured in a graph.

    PYTHONPATH=src python bench/bench_kda.py [--out DIR] [--no-ref] [--lower-bound -5 | --softplus]
"""

# every lambda below is timed immediately inside its loop iteration, so late binding is harmless
# ruff: noqa: B023

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Callable

import torch
from common import copy_bandwidth, eager_ms  # noqa: E402

from k3run.kernels.kda import chunk_kda, kda_backend, kda_forward, kda_gate, l2norm
from k3run.kernels.kda.ref import chunk_kda_ref, recurrent_kda_ref
from k3run.testing import rel_rms_error

H, K, V = 96, 128, 128
PREFILL = [("1 x 8192", [0, 8192]), ("4 x 2048", [0, 2048, 4096, 6144, 8192])]
DECODE_B = [1, 16, 64]
DEVICE = "cuda"


def inputs(cu: list[int], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    T, B = cu[-1], len(cu) - 1
    dev = DEVICE
    return {
        "q": torch.randn(T, H, K, device=dev, dtype=dtype),
        "k": torch.randn(T, H, K, device=dev, dtype=dtype),
        "v": torch.randn(T, H, V, device=dev, dtype=dtype),
        "f": torch.randn(T, H, K, device=dev, dtype=dtype),
        "b": torch.randn(T, H, device=dev, dtype=dtype),
        "A_log": torch.randn(H, device=dev) * 0.5,
        "dt_bias": torch.randn(H * K, device=dev),
        "h0": torch.randn(B, H, K, V, device=dev) * 0.1,
        "cu": torch.tensor(cu, dtype=torch.int64, device=dev),
    }


def time_ms(fn: Callable[[], object], slow: bool = False) -> float:
    # the reference takes ~0.1-1 s per call: one warm-up, one timed repetition
    if slow:
        return eager_ms(fn, warmup=1, rep=1)
    return eager_ms(fn, rep=200)


def run(args: argparse.Namespace) -> list[dict]:
    lb = None if args.softplus else args.lower_bound
    scale = K**-0.5
    dtype = torch.bfloat16
    rows: list[dict] = []

    def raw(x: dict[str, torch.Tensor], decode: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return kda_forward(
            x["q"], x["k"], x["v"], x["f"], x["b"], A_log=x["A_log"], dt_bias=x["dt_bias"],
            lower_bound=lb, scale=scale, initial_state=x["h0"], cu_seqlens=x["cu"], decode=decode,
        )  # fmt: skip

    def activated(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        g = kda_gate(x["f"], x["A_log"], x["dt_bias"], lb)
        return l2norm(x["q"]), l2norm(x["k"]), g, torch.sigmoid(x["b"].float())

    def reference(x: dict[str, torch.Tensor], decode: bool) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, g, beta = activated(x)
        ref = recurrent_kda_ref if decode else chunk_kda_ref
        return ref(q, k, x["v"], g, beta, scale, x["h0"], x["cu"])

    for label, cu in PREFILL:
        x = inputs(cu, dtype)
        q, k, g, beta = activated(x)
        o, ht = raw(x, decode=False)
        row = {"case": f"chunk {label}", "T": cu[-1], "B": len(cu) - 1}
        row["fla_ms"] = time_ms(lambda: raw(x, decode=False))
        row["fla_act_ms"] = time_ms(
            lambda: chunk_kda(q, k, x["v"], g, beta, scale=scale, initial_state=x["h0"], cu_seqlens=x["cu"])
        )
        if not args.no_ref:
            o_ref, ht_ref = reference(x, decode=False)
            row["ref_ms"] = time_ms(lambda: reference(x, decode=False), slow=True)
            row["err_o"], row["err_state"] = rel_rms_error(o_ref, o), rel_rms_error(ht_ref, ht)
        row["tokens_per_s"] = cu[-1] / (row["fla_ms"] * 1e-3)
        rows.append(row)

    for B in DECODE_B:
        x = inputs(list(range(B + 1)), dtype)
        o, ht = raw(x, decode=True)
        row = {"case": f"recurrent B={B}", "T": B, "B": B}
        row["fla_ms"] = time_ms(lambda: raw(x, decode=True))
        if not args.no_ref:
            o_ref, ht_ref = reference(x, decode=True)
            row["ref_ms"] = time_ms(lambda: reference(x, decode=True), slow=True)
            row["err_o"], row["err_state"] = rel_rms_error(o_ref, o), rel_rms_error(ht_ref, ht)
        row["state_bytes"] = 2 * B * H * K * V * 4  # fp32 states read once and written once
        rows.append(row)
    return rows


def print_table(rows: list[dict], copy_bw: float) -> None:
    print(f"copy bandwidth (read+write): {copy_bw / 1e12:.2f} TB/s")
    print(f"KDA H={H} K=V={K}, bf16 activations, fp32 states (kda backend on cuda: {kda_backend('cuda')})")
    head = (
        f"{'case':>20} {'fla ms':>9} {'act ms':>9} {'ref ms':>10} {'x ref':>8} "
        f"{'state TB/s':>10} {'%copy':>6} {'err o':>8} {'err S':>8}"
    )
    print(head)
    for r in rows:
        ref = r.get("ref_ms")
        tbs = r["state_bytes"] / (r["fla_ms"] * 1e-3) / 1e12 if "state_bytes" in r else None
        print(
            f"{r['case']:>20} {r['fla_ms']:>9.4f} "
            f"{r['fla_act_ms'] if 'fla_act_ms' in r else float('nan'):>9.4f} "
            f"{ref if ref is not None else float('nan'):>10.3f} "
            f"{ref / r['fla_ms'] if ref is not None else float('nan'):>8.1f} "
            f"{tbs if tbs is not None else float('nan'):>10.2f} "
            f"{100 * tbs * 1e12 / copy_bw if tbs is not None else float('nan'):>6.1f} "
            f"{r.get('err_o', float('nan')):>8.1e} {r.get('err_state', float('nan')):>8.1e}"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="folder for the JSON")
    ap.add_argument("--no-ref", action="store_true", help="skip the (slow) fp32 reference")
    ap.add_argument("--lower-bound", type=float, default=-5.0, help="K3 gate lower bound (default -5)")
    ap.add_argument("--softplus", action="store_true", help="Kimi Linear gate (no lower bound) instead")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_kda: needs a CUDA GPU", file=sys.stderr)
        return 2
    if kda_backend("cuda") != "fla":
        print("bench_kda: fla-core is not importable; install the gpu extra", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    copy_bw = copy_bandwidth() * 1e12  # bytes / s
    with torch.inference_mode():
        rows = run(args)
    print_table(rows, copy_bw)
    os.makedirs(args.out, exist_ok=True)
    record = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "argv": sys.argv,
        "copy_bw": copy_bw,
        "rows": rows,
    }
    with open(os.path.join(args.out, "bench_kda.json"), "w") as fh:
        json.dump(record, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
