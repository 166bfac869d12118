"""One second CUDA stream per device, shared by the work that runs beside the caller's stream: a layer's
independent branch (layers/branch.py) and the chunked dequantize beside cuBLAS (nvfp4_gemm/dequant_mm.py).
Each forks from the caller's stream and joins back into it before it returns, so sharing the stream only
orders their side work, which never overlaps in one call."""

from __future__ import annotations

import torch

_STREAMS: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of CUDA `device` (made at first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _STREAMS.get(index)
    if stream is None:
        stream = _STREAMS[index] = torch.cuda.Stream(device=index)
    return stream
