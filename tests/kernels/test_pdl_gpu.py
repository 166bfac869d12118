"""The decode step's small Triton kernels launched with programmatic dependent launch (K3RUN_PDL_ALL=1,
kernels/pdl.py) on a GPU: a chain of them, each reading the previous one's output, gives the same bits as
without PDL, eagerly and replayed from a CUDA graph (where the launches become programmatic edges). The PTX
side (the wait before any memory access) is test_pdl_compile.py's."""

from __future__ import annotations

import pytest
import torch

from k3run.knobs import override_knobs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs sm_90+"
    ),
]


def _chain(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, rw: torch.Tensor, bias: torch.Tensor):
    """norm with the residual add, the router (two launches and one), expert grouping, the gated activation,
    the combine, KDA's decode conv and a last norm: every kernel reads what the one before it wrote."""
    from k3run.kernels.kda.conv import causal_conv1d_decode_in_place_triton
    from k3run.kernels.moe_ops.triton import (
        combine_triton,
        gated_triton,
        route_one_launch_triton,
        router_partials,
        sigmoid_topk_triton,
    )
    from k3run.kernels.norm.triton import rms_norm_triton
    from k3run.kernels.nvfp4_gemm.groups import expert_groups

    t, d = x.shape
    h, s = rms_norm_triton(x, w, 1e-5, residual=res)
    wts, ids = sigmoid_topk_triton(router_partials(h, rw), bias, 8, True, 2.5, 256)
    wts1, ids1 = route_one_launch_triton(h, rw, bias, 8, True, 2.5, 256)
    grp = expert_groups(ids.reshape(-1), 257, 8)
    gu = h.repeat(1, 2)[:, : 2 * 1024].repeat_interleave(9, 0) * (1 + ids.reshape(-1, 1).to(h.dtype) / 256)
    act = gated_triton(gu, "silu", 1.0, None, h.dtype)
    y = combine_triton(act.repeat(1, 3)[:, :d].contiguous(), wts, h.dtype, s)
    pool = torch.zeros(4, 3 * 64, 3, dtype=h.dtype, device=h.device)
    rec = torch.ones(4, 2, 8, 8, device=h.device)
    conv = causal_conv1d_decode_in_place_triton(
        y[:, : 3 * 64].contiguous(), w[: 3 * 64, None].float().repeat(1, 4), pool,
        torch.arange(t, device=h.device) % 4, torch.zeros(t, dtype=torch.int64, device=h.device), groups=3,
        zero_pool=rec,
    )  # fmt: skip
    out, _ = rms_norm_triton(y, w, 1e-5, residual=s)
    return out, wts, ids, wts1, ids1, grp, conv, pool, rec


def _inputs(t: int):
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, 2304, generator=g).to("cuda", torch.bfloat16)
    res = torch.randn(t, 2304, generator=g).to("cuda", torch.bfloat16)
    w = (torch.rand(2304, generator=g) + 0.5).to("cuda", torch.bfloat16)
    rw = (torch.randn(256, 2304, generator=g) / 48).cuda()
    bias = (torch.randn(256, generator=g) * 0.1).cuda()
    return x, res, w, rw, bias


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, or for the expert group table (int32 [G, 9]) the same groups: its atomic form places an
    expert's picks in the order its atomics land in (groups.same_groups)."""
    from k3run.kernels.nvfp4_gemm.groups import same_groups

    if a.dtype == torch.int32 and a.dim() == 2 and a.shape[1] == 9:
        return same_groups(b, a)
    return torch.equal(a, b)


@pytest.mark.parametrize("t", [1, 4])
def test_gpu_pdl_chain_equals_plain_launches(t: int) -> None:
    args = _inputs(t)
    with override_knobs(pdl_all=False):
        want = _chain(*args)
    with override_knobs(pdl_all=True):
        got = _chain(*args)
        torch.cuda.synchronize()
        for a, b in zip(want, got, strict=True):
            assert _same(a, b)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            _chain(*args)
            with torch.cuda.graph(graph, stream=stream):
                out = _chain(*args)
        torch.cuda.current_stream().wait_stream(stream)
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            for a, b in zip(want, out, strict=True):
                assert _same(a, b)
