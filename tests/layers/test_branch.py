"""layers/branch.py: a layer's independent branch on a second CUDA stream gives the inline result, eagerly and
inside a captured CUDA graph, and runs inline where it does not apply."""

from __future__ import annotations

import pytest
import torch

from k3run.knobs import knobs, override_knobs
from k3run.layers.branch import Branch, side_stream_applies

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cpu_branches_run_inline() -> None:
    x = torch.randn(3, 5)
    calls = []
    b = Branch(lambda: calls.append(1) or x * 2, x)
    assert calls == [1], "an inline branch runs at once"
    assert not b.on_side_stream and not side_stream_applies(x)
    assert torch.equal(b.result(), x * 2)


def _chain(w: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    for m in w:  # several dependent launches, so the branch is still running when the main chain goes on
        x = torch.tanh(x @ m)
    return x


@needs_cuda
@pytest.mark.gpu
def test_gpu_branch_equals_inline_eager_and_in_a_graph() -> None:
    g = torch.Generator().manual_seed(0)
    w = [(torch.randn(512, 512, generator=g) / 16).cuda() for _ in range(6)]
    x = torch.randn(8, 512, generator=g).cuda()

    def step(inp: torch.Tensor) -> torch.Tensor:
        b = Branch(lambda: _chain(w, inp), inp)
        assert b.on_side_stream
        main = _chain(w[::-1], inp)
        return main + b.result()

    want = _chain(w[::-1], x) + _chain(w, x)
    assert torch.equal(step(x), want)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = step(static)
    for trial in range(3):
        static.copy_(x * (trial + 1))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, _chain(w[::-1], static) + _chain(w, static))
    # inline above K3RUN_SIDE_MAX_TOKENS rows and with the switch off
    big = torch.randn(knobs().side_max_tokens + 1, 512, device="cuda")
    assert not Branch(lambda: big, big).on_side_stream
    with override_knobs(side_max_tokens=big.shape[0]):
        assert Branch(lambda: big, big).on_side_stream
    with override_knobs(side_stream=False):
        assert not Branch(lambda: x, x).on_side_stream
    assert not Branch(lambda: x, x, enabled=False).on_side_stream
