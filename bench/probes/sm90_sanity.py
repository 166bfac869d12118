"""Question: does the sm_90 CUDA NVFP4 GEMM (kernels/nvfp4_gemm/w4a16_sm90.cu) run to completion and agree
with the fp32 reference on small cases, with no memory error or shared-memory race? Meant to run first, each
case in a few milliseconds, under a hard timeout and the sanitizer:

    timeout -s KILL 300 compute-sanitizer --tool memcheck python3 bench/probes/sm90_sanity.py
    timeout -s KILL 300 compute-sanitizer --tool racecheck python3 bench/probes/sm90_sanity.py --one

(--one: four cases, the thread producer with two warpgroups, the tensor producer, three warpgroups' split-K
and the warp producer through reused slots, then the x-gather cases, whose shared stores racecheck watches
beside the wgmma reads.) Prints one line per case (config, relative RMS error, max error over the bound)
and exits non-zero on a failure. Answers so far: memcheck clean, every case within its bound
(bench/RESULTS.md runs 126, 152 and 160, the last with the warp and tensor producers' cases; run 188 with
three warpgroups'). `--pick 6,15` runs those cases of the full list (the cases, then the x-gather ones)
alone.
"""

from __future__ import annotations

import sys

import torch


def run_case(m: int, n: int, k: int, cfg, producer: str, gather: bool) -> tuple[bool, str]:
    """One GEMM of random NVFP4 weights [n, k] and bf16 x [m, k] (with `gather`, x a column slice of a wider
    tensor) at `cfg` / `producer` against the fp32 reference: (within the bound, the printed line). Bound:
    3 K fp32 roundings of |x| @ |W| (the sums' order) plus one bf16 rounding of the output."""
    from k3run.formats import dequantize_nvfp4, quantize_nvfp4
    from k3run.kernels.nvfp4_gemm import prepare_nvfp4_weight
    from k3run.kernels.nvfp4_gemm import w4a16_sm90 as sm90

    g = torch.Generator().manual_seed(m + n + k)
    q = quantize_nvfp4(torch.randn(n, k, generator=g))
    tw = prepare_nvfp4_weight(q.weight.cuda(), q.weight_scale.cuda(), q.weight_scale_2.cuda(), "tiled128")
    x = torch.randn(m, k + 8 * gather, generator=g).to(torch.bfloat16).cuda()[:, :k]
    y = sm90.nvfp4_sm90_gemm(
        x, tw.weight, tw.scale_bits, tw.global_scale, k, n, config=cfg, producer=producer, gather=gather
    )
    torch.cuda.synchronize()
    wd = dequantize_nvfp4(q.weight, q.weight_scale, q.weight_scale_2, dtype=torch.float32)
    ref = x.float().cpu() @ wd.t()
    bound = 3 * k * 2.0**-24 * (x.float().abs().cpu() @ wd.abs().t()) + ref.abs() * 2.0**-8
    err = (y.float().cpu() - ref).abs()
    rel = float(err.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
    worst = float((err / bound).max())
    ok = bool(torch.isfinite(y).all()) and worst <= 1.0
    form = ("" if producer == "thread" else f" {producer} producer") + (" x gather" if gather else "")
    verdict = "ok" if ok else "FAIL"
    return ok, f"{m}x{n}x{k} {cfg}{form}: rel RMS {rel:.2e}, worst error / bound {worst:.2f} {verdict}"


def main() -> int:
    from k3run.kernels.nvfp4_gemm import w4a16_sm90 as sm90

    if not sm90.available():
        print("not available:", sm90._error)
        return 1
    # (m, n, k, config, producer): the fifth and sixth stream-K (split_k 0) over stream_k_ctas' default
    # grid; then the producer's warp and tensor forms (K3RUN_SM90_PRODUCER; the tensor form's second case
    # with two consumer warpgroups, an 8-row-block box); then the tail split with two warpgroups; then two of
    # three warpgroups (one A set each; N ends inside a 192-row tile; split-K over the thread producer); the
    # last two 16 chunks through a ring of 2 slots (every slot reused: racecheck sees the consumers' reads of
    # a slot and the producer's next bulk copy into it)
    cases = [(20, 200, 336, (32, 2, 1, 3), "thread"), (9, 144, 384, (16, 1, 3, 2), "thread"),
             (130, 256, 1024, (256, 1, 2, 3), "thread"), (64, 512, 896, (64, 2, 7, 4), "thread"),
             (37, 328, 2048, (16, 1, 0, 4), "thread"), (100, 1024, 1024, (64, 1, 0, 3), "thread"),
             (9, 144, 384, (16, 1, 3, 2), "warp"), (37, 328, 2048, (16, 1, 0, 4), "warp"),
             (9, 144, 384, (16, 1, 3, 2), "tensor"), (20, 200, 336, (32, 2, 1, 3), "tensor"),
             (37, 328, 2048, (16, 1, 0, 4), "tensor"),
             (300, 1000, 2048, (128, 2, -2, 3), "tensor"),
             (200, 1000, 2048, (128, 3, 1, 4), "tensor"),
             (150, 328, 768, (128, 3, 2, 3), "thread"),
             (17, 200, 2048, (32, 1, 1, 2), "warp"), (17, 200, 2048, (32, 1, 1, 2), "thread")]  # fmt: skip
    cases_all = cases
    if "--one" in sys.argv:  # racecheck: thread form, two warpgroups; tensor; three; warp, reused slots
        cases = [cases[0], cases[10], cases[13], cases[14]]
    # the x gather (the GEMM copies x [M, K] itself): odd M, a part last chunk, x a column slice
    gathered = [
        (9, 328, 720, (16, 1, 2, 3), "tensor"),
        (17, 200, 336, (32, 1, 1, 2), "warp"),
        (17, 200, 2048, (32, 1, 1, 2), "warp"),
    ]
    runs = [(c, False) for c in cases] + [(c, True) for c in gathered]
    for i, arg in enumerate(sys.argv):  # --pick 6,15: those of the full list (cases, then gathered) alone
        if arg == "--pick":
            every = [(c, False) for c in cases_all] + [(c, True) for c in gathered]
            runs = [every[int(j)] for j in sys.argv[i + 1].split(",")]
    bad = 0
    for (m, n, k, cfg, producer), gather in runs:
        ok, line = run_case(m, n, k, cfg, producer, gather)
        bad += not ok
        print(line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
