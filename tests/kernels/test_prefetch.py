"""kernels/prefetch.py: which layers a step queues, which weights a layer's table holds, the sm_90 build of
the bulk-prefetch kernel, and on a GPU that a prefetch (eager and in a graph) leaves every byte as it was.
What the prefetch buys is bench/probes/l2_prefetch.py's question."""

from __future__ import annotations

import re

import pytest
import torch

from k3run.kernels.prefetch import CHUNK, chunk_starts, layers_to_queue


def test_layers_are_queued_once_each_ahead_of_their_use() -> None:
    """A step of 5 layers two ahead: layers 1 and 2 at the first layer's start, then one a layer, none past
    the last and never the layer that is starting (its weights are needed now)."""
    queued, got = 0, []
    for i in range(5):
        todo = layers_to_queue(i, 2, queued, 5)
        got.append(list(todo))
        queued = max(queued, todo.stop)
    assert got == [[1, 2], [3], [4], [], []]
    assert list(layers_to_queue(0, 4, 0, 2)) == [1]


def test_chunk_starts_cover_every_byte() -> None:
    sizes = [1, CHUNK, CHUNK + 16, 5 * CHUNK - 3]
    starts = chunk_starts(sizes)
    assert starts == [0, 1, 2, 4, 9]
    assert all((b - a) * CHUNK >= n > (b - a - 1) * CHUNK for a, b, n in zip(starts, starts[1:], sizes))


def test_layer_tables_hold_the_dense_weights_not_the_routed_experts() -> None:
    """decode_weights on a K3-mixed random model: every layer's norms and its linears' parameters are in, no
    routed expert's parameter is."""
    from k3run.layers.linear import LinearBase
    from k3run.layers.moe import KimiMoE
    from k3run.models.kimi import decode_weights
    from tests.test_bench_tools import TINY, bench_module

    model = bench_module("k3_shaped").random_k3_model(layers=4, experts=8, device="cpu", dims=TINY)
    linears = 0
    for layer in model.layers:
        got = {id(t) for t in decode_weights(layer)}
        assert id(layer.input_layernorm.weight) in got and id(layer.post_attention_layernorm.weight) in got
        experts = layer.mlp.experts if isinstance(layer.mlp, KimiMoE) else None
        if experts is not None:
            assert not got & {id(p) for p in experts.parameters()}, "a routed expert's weight"
        for m in layer.modules():
            if isinstance(m, LinearBase) and not hasattr(m, "nvfp4_weight"):
                linears += 1
                assert {id(p) for p in m.parameters(recurse=False)} <= got, m
    assert linears, "no linear outside the experts: the test checks nothing"


def test_nvfp4_linears_give_their_kernel_layout_not_the_checkpoint_copy() -> None:
    from k3run.kernels.nvfp4_gemm import prepare_nvfp4_weight
    from k3run.models.kimi import decode_weights

    lin = torch.nn.Module()
    lin.weight = torch.nn.Parameter(torch.zeros(32, 16, dtype=torch.uint8), requires_grad=False)
    scale = torch.ones(32, 2).to(torch.float8_e4m3fn)
    lin.nvfp4_weight = prepare_nvfp4_weight(lin.weight.data.clone(), scale, torch.ones(1))
    layer = torch.nn.Module()
    layer.proj = lin
    layer.norm = torch.nn.Parameter(torch.ones(32), requires_grad=False)
    got = {id(t) for t in decode_weights(layer)}
    assert got == {id(lin.nvfp4_weight.weight), id(lin.nvfp4_weight.scale_bits), id(layer.norm)}


def test_prefetch_kernel_compiles_for_sm90() -> None:
    """The bulk prefetch assembles for sm_90 (ptxas), one instruction a program, nothing on the stack."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from k3run.kernels.prefetch import _prefetch_l2_kernel
    from tests.kernels.test_nvfp4_gemv_compile import cubin_usage_and_sass

    src = ASTSource(_prefetch_l2_kernel, {"tab_ptr": "*i64", "N": "i32", "CHUNK": "constexpr"}, {(2,): CHUNK})
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    assert ck.asm["ptx"].count("cp.async.bulk.prefetch.L2.global") == 1
    res, sass = cubin_usage_and_sass(ck)
    use = re.search(r"REG:(\d+) STACK:(\d+)", res)
    assert use is not None and int(use.group(2)) == 0, res
    assert "UBLKPF" in sass or "PREFETCH" in sass.upper() or "BLKPF" in sass, "no bulk prefetch in the SASS"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_prefetch_changes_no_byte_eager_or_in_a_graph() -> None:
    from k3run.kernels.prefetch import PrefetchTable, prefetch_l2

    g = torch.Generator(device="cuda").manual_seed(0)
    ts = [
        torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)
        for n in (16, 3 * CHUNK + 48, 1000)
    ]
    ts.append(torch.randn(7, 33, device="cuda"))  # 924 bytes: a tail not a multiple of 16
    before = [t.clone() for t in ts]
    table = PrefetchTable(ts)
    assert len(table) == 4 and table.nbytes == sum(t.numel() * t.element_size() for t in ts)
    prefetch_l2(table)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prefetch_l2(table)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(ts, before, strict=True))
