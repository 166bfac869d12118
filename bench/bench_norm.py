"""Fused RMSNorm / gated RMSNorm / AttnRes mix (kernels/norm) against the torch references they replace, at
K3's decode and prefill shapes, on one GPU.

Per row: the fused kernel's time, its bytes (inputs read once + output written once) as GB/s and as % of
the device copy bandwidth measured in the same run (the ceiling), the torch reference's time (the baseline:
what the layers ran before), and the speed-up. Timing: common.graph_ms (a graph of
back-to-back calls, as a decode step replays them; median).

    PYTHONPATH=src python bench/bench_norm.py
"""

# every lambda below is timed immediately inside its loop iteration, so late binding is harmless
# ruff: noqa: B023

from __future__ import annotations

import torch
from common import copy_bandwidth, graph_ms  # noqa: E402

from k3run.kernels.norm import attn_res_mix_ref, rms_norm_ref
from k3run.kernels.norm.triton import attn_res_mix_triton, rms_norm_triton
from k3run.testing import rel_rms_error

D, H, HD = 7168, 96, 128  # K3: hidden, KDA heads, head dim (o_norm normalises per head)


def _time(fn) -> float:
    return graph_ms([fn]) * 1e3  # us


def _row(name: str, shape: str, fused: float, gbs: float, copy_tbs: float, ref: float, err: float) -> None:
    pct = gbs / copy_tbs / 10  # GB/s over TB/s * 1000, in percent
    left = f"{name:<28} {shape:>16} {fused:>9.2f} {gbs:>7.0f} {pct:>5.1f}%"
    print(f"{left} {ref:>9.2f} {ref / fused:>7.1f}x {err:>8.1e}")


def main() -> None:
    copy_tbs = copy_bandwidth()
    dt = torch.bfloat16
    print(f"{torch.cuda.get_device_name()}: copy bandwidth (read + write) {copy_tbs:.2f} TB/s")
    head = f"{'op':<28} {'shape':>16} {'fused us':>9} {'GB/s':>7} {'%copy':>6}"
    print(f"{head} {'torch us':>9} {'speed-up':>8} {'rel err':>8}")
    rows = []
    for t in (1, 8, 4096):
        rows.append(("rms_norm", (t, D), False))
        rows.append(("gated rms_norm (o_norm)", (t * H, HD), True))
    for name, shape, gated in rows:
        x = torch.randn(shape, device="cuda", dtype=dt)
        w = torch.rand(shape[-1], device="cuda", dtype=dt) + 0.5
        g = torch.randn(shape, device="cuda", dtype=dt) if gated else None
        fused = _time(lambda: rms_norm_triton(x, w, 1e-5, g))
        ref = _time(lambda: rms_norm_ref(x, w, 1e-5, g))
        err = rel_rms_error(rms_norm_ref(x, w, 1e-5, g).float(), rms_norm_triton(x, w, 1e-5, g).float())
        nbytes = x.numel() * 2 * (3 if gated else 2)
        gbs = nbytes / fused / 1e3
        _row(name, str(shape), fused, gbs, copy_tbs, ref, err)
    for n, t in ((2, 1), (8, 1), (8, 8), (8, 4096)):
        cands = [torch.randn(t, D, device="cuda", dtype=dt) for _ in range(n)]
        q = torch.randn(D, device="cuda") / D**0.5
        fused = _time(lambda: attn_res_mix_triton(cands, q, 1e-5))
        ref = _time(lambda: attn_res_mix_ref(cands, q, 1e-5))
        err = rel_rms_error(
            attn_res_mix_ref(cands, q, 1e-5).float(), attn_res_mix_triton(cands, q, 1e-5).float()
        )
        nbytes = (n + 1) * t * D * 2  # the floor: candidates read once, output written once
        gbs = nbytes / fused / 1e3
        name = f"attn_res_mix n={n}"
        _row(name, str((t, D)), fused, gbs, copy_tbs, ref, err)


if __name__ == "__main__":
    main()
