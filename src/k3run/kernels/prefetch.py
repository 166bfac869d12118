"""Weights prefetched into the L2 ahead of their use (sm_90: `cp.async.bulk.prefetch.L2`).

At decode sizes most NVFP4 matrices are 0.2-16 MB and a GEMV spends most of its time ramping up, not
streaming: a batch-1 step reads its dense weights at ~25% of the copy bandwidth (bench/NOTES.md). A
prefetch of the next layers' dense weights, queued on a stream of its own while the current layer runs,
lets those GEMVs read from the L2. The prefetch is a hint: it reads nothing into registers and writes
nothing, so results are unchanged bit for bit; a prefetched line the L2 evicts before use costs only its
DRAM read.

`PrefetchTable(tensors)` records, once, where each tensor's bytes are (addresses are stable: weights do not
move after loading); `prefetch_l2(table)` issues all of them in one launch, one bulk prefetch of up to
CHUNK bytes per program.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

CHUNK = 32 << 10  # bytes per bulk prefetch (one program each)


@triton.jit
def _prefetch_l2_kernel(tab_ptr, N, CHUNK: tl.constexpr):
    # tab [N, 3] int64: address, bytes, first chunk; this program's chunk is in the last entry whose first
    # chunk is <= it (the entries are few: a decoder layer's dense tensors)
    p = tl.program_id(0).to(tl.int64)
    addr = p * 0
    left = p * 0
    for j in range(N):
        first = tl.load(tab_ptr + 3 * j + 2)
        mine = first <= p
        off = (p - first) * CHUNK
        addr = tl.where(mine, tl.load(tab_ptr + 3 * j) + off, addr)
        left = tl.where(mine, tl.load(tab_ptr + 3 * j + 1) - off, left)
    size = (tl.minimum(tl.maximum(left, 0), CHUNK) // 16 * 16).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


def chunk_starts(nbytes: list[int], chunk: int = CHUNK) -> list[int]:
    """The first chunk index of each tensor's bytes, then the total chunk count."""
    starts = [0]
    for n in nbytes:
        starts.append(starts[-1] + -(-n // chunk))
    return starts


@functools.cache
def prefetch_available(index: int) -> bool:
    """Bulk L2 prefetch needs sm_90 or later."""
    return torch.cuda.get_device_capability(index) >= (9, 0)


class PrefetchTable:
    """The bytes of `tensors` (CUDA, contiguous; others are skipped) as one launch's table on their device."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        keep = [
            t for t in tensors if t.is_cuda and t.is_contiguous() and t.numel() and t.data_ptr() % 16 == 0
        ]
        self.device = keep[0].device if keep else None
        sizes = [t.numel() * t.element_size() for t in keep]
        self.nbytes = sum(sizes)
        starts = chunk_starts(sizes)
        self.chunks = starts[-1]
        rows = [[t.data_ptr(), n, s] for t, n, s in zip(keep, sizes, starts, strict=False)]
        self.table = torch.tensor(rows, dtype=torch.int64, device=self.device) if keep else None
        self._refs = keep  # the addresses stay valid while the table lives

    def __len__(self) -> int:
        return 0 if self.table is None else self.table.shape[0]


def prefetch_l2(table: PrefetchTable) -> None:
    """Queue the bulk L2 prefetch of the table's bytes on the current stream (one launch; nothing where the
    table is empty or the device has no bulk prefetch)."""
    if table.table is None or table.device is None or not prefetch_available(table.device.index or 0):
        return
    _prefetch_l2_kernel[(table.chunks,)](table.table, len(table), CHUNK=CHUNK, num_warps=1)


_STREAMS: dict[int, torch.cuda.Stream] = {}


def _stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        _STREAMS[index] = torch.cuda.Stream(device=index)
    return _STREAMS[index]


def layers_to_queue(i: int, ahead: int, queued: int, layers: int) -> range:
    """The layers whose prefetch is queued at layer i's start: those after i up to i + ahead not queued yet
    (`queued`: the first not queued, 0 before the step's first call)."""
    return range(max(queued, i + 1), min(i + ahead, layers - 1) + 1)


class LayerPrefetch:
    """One step's prefetches, `ahead` layers ahead, on a stream of their own: `before(i)` (at layer i's
    start) queues the layers up to i + ahead not yet queued, after everything queued so far on the current
    stream; `join()` makes the current stream wait for them (a graph capture must join every fork)."""

    def __init__(self, tables: list[PrefetchTable], ahead: int, device: torch.device) -> None:
        self.tables, self.ahead = tables, ahead
        self.main, self.side = torch.cuda.current_stream(device), _stream(device)
        self.queued = 0  # the first layer not queued yet

    def before(self, i: int) -> None:
        todo = layers_to_queue(i, self.ahead, self.queued, len(self.tables))
        if not todo:
            return
        self.side.wait_stream(self.main)
        with torch.cuda.stream(self.side):
            for j in todo:
                prefetch_l2(self.tables[j])
        self.queued = todo.stop

    def join(self) -> None:
        if self.queued:
            self.main.wait_stream(self.side)
