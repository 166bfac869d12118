"""Dequantize + cuBLAS for NVFP4 linears of many rows, the weight's rows in chunks on a second stream.

Above the tile kernels' rows (`choose_config`'s `dequant_mm`) a linear writes its weight as bf16 (a kernel at
about the copy rate: ~110-130 us for 12288 x 7168 on an H200) and then runs cuBLAS on it; at 4096 rows that
write is ~10% of the call (0.89-0.90x cuBLAS bf16 on two K3 shapes, bench/RESULTS.md). With
K3RUN_DEQUANT_CHUNKS = C > 1 the weight's rows go in C chunks (multiples of 16 rows: whole tiled128 row
blocks, so a chunk is a slice of the weight, its scales and a per-row global scale): a side stream dequantizes
chunk j + 1 into one of two buffers while the caller's stream multiplies chunk j into its columns of y (the
shared side stream, kernels/streams.py), so only the first chunk's write is not hidden, and the bf16 copy held
is two chunks, not the whole weight. Each output column is computed from the same dequantized row and x as in
the one-chunk form; cuBLAS may pick another kernel for the narrower product, so the two agree within bf16
rounding, not bit for bit. The streams fork from and join into the caller's stream with events, so a CUDA
graph can capture it. Measured (H100, 4096 rows, bench/bench_dequant_chunks.py): slower than one chunk on
7168 x 7168 and 7168 x 12288 at 2, 4 and 8 chunks (the narrower products and the side stream's share of the
SMs and the power cost more than the hidden write), 1.04x faster on 12288 x 7168 at 8; so it stays opt-in.
"""

from __future__ import annotations

import torch

from k3run.kernels.streams import side_stream

from .layout import NvFp4Weight


def chunk_rows(n: int, chunks: int) -> list[tuple[int, int]]:
    """[r0, r1) row ranges of at most `chunks` chunks covering n rows, each a multiple of 16 rows but the
    last, as even as 16-row blocks allow."""
    if n <= 0 or chunks < 1:
        raise ValueError(f"chunk_rows: n={n}, chunks={chunks}; both must be >= 1")
    blocks = -(-n // 16)
    per = -(-blocks // min(chunks, blocks)) * 16
    return [(r0, min(n, r0 + per)) for r0 in range(0, n, per)]


def dequant_mm_chunked(
    x2: torch.Tensor, w: NvFp4Weight, bias: torch.Tensor | None, chunks: int
) -> torch.Tensor:
    """y [M, N] = x2 [M, K] @ W^T + bias for a tiled128 NVFP4 weight on CUDA, the weight dequantized in
    `chunks` row chunks on a side stream while the caller's stream multiplies the previous one."""
    from .triton import nvfp4_dequantize

    if w.layout != "tiled128" or not x2.is_cuda:
        raise ValueError(f"dequant_mm_chunked: a tiled128 weight on CUDA, got {w.layout!r} on {x2.device}")
    n, k, dtype = w.n, w.k, x2.dtype
    bounds = chunk_rows(n, chunks)
    per = bounds[0][1] - bounds[0][0]
    main = torch.cuda.current_stream(x2.device)
    side = side_stream(x2.device)
    y = torch.empty(x2.shape[0], n, dtype=dtype, device=x2.device)
    bufs = [torch.empty(per, k, dtype=dtype, device=x2.device) for _ in range(min(2, len(bounds)))]
    per_row_gs = w.global_scale.numel() != 1
    side.wait_stream(main)  # the fork: x2 and everything before this call are ready
    used: list[torch.cuda.Event] = []
    for j, (r0, r1) in enumerate(bounds):
        buf = bufs[j % 2][: r1 - r0]
        with torch.cuda.stream(side):
            if j >= 2:  # the buffer's previous chunk has been multiplied
                side.wait_event(used[j - 2])
            r1p = r0 + -(-(r1 - r0) // 16) * 16  # the chunk's rows with the last block's padding
            gs = w.global_scale[r0:r1p] if per_row_gs else w.global_scale
            nvfp4_dequantize(
                w.weight[r0:r1p], w.scale_bits[r0:r1p], gs, k, dtype, rows=r1 - r0, out=buf
            )  # fmt: skip
            ready = torch.cuda.Event()
            ready.record(side)
        main.wait_event(ready)
        out = y[:, r0:r1]
        if bias is None:
            torch.mm(x2, buf.t(), out=out)
        else:
            torch.addmm(bias[r0:r1], x2, buf.t(), out=out)
        done = torch.cuda.Event()
        done.record(main)
        used.append(done)
    # the join: the caller's stream waited for every chunk's dequantize, so the side stream has nothing of
    # this call's left after it, and the buffers (freed on the caller's stream) are safe to reuse
    return y
