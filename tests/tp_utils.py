"""Helpers shared by the linear / loader tests: checkpoint tensors per scheme, their exact dequantized
references, layers filled through their weight loaders, and simulated or spawned TP ranks."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from k3run.distributed import TPInfo
from k3run.formats import (
    dequantize_fp8_act_1x128,
    dequantize_fp8_block,
    dequantize_nvfp4,
    nvfp4_qdq,
    quantize_fp8_act_1x128,
    quantize_fp8_block,
    quantize_nvfp4,
)
from k3run.quant.algo import QuantAlgo
from k3run.quant.schemes import Fp8PbWoScheme, LinearScheme, NvFp4Scheme, UnquantizedScheme

KINDS = ("none", "fp8", "nvfp4")


def make_scheme(kind: str, *, w4a4: bool = False) -> LinearScheme:
    if kind == "none":
        return UnquantizedScheme()
    if kind == "fp8":
        return Fp8PbWoScheme()
    if kind == "nvfp4":
        return NvFp4Scheme(QuantAlgo.NVFP4, w4a4=w4a4)
    raise ValueError(kind)


def checkpoint_tensors(
    kind: str, w: torch.Tensor, input_scale: float = 1.0, weight_scale_2: float | None = None
) -> dict[str, torch.Tensor]:
    """What a ModelOpt export holds for the fp32 weight `w` [N, K] under `kind` (names without prefix)."""
    if kind == "none":
        return {"weight": w.clone()}
    if kind == "fp8":
        q, s = quantize_fp8_block(w)
        return {"weight": q, "weight_scale": s}
    t = quantize_nvfp4(w, weight_scale_2)
    return {
        "weight": t.weight,
        "weight_scale": t.weight_scale,
        "weight_scale_2": t.weight_scale_2.reshape(()),
        "input_scale": torch.tensor(input_scale, dtype=torch.float32),
    }


def dequantized(kind: str, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """The exact fp32 weight the checkpoint tensors `t` stand for."""
    if kind == "none":
        return t["weight"].float()
    if kind == "fp8":
        return dequantize_fp8_block(t["weight"], t["weight_scale"])
    return dequantize_nvfp4(t["weight"], t["weight_scale"], t["weight_scale_2"])


def activation_reference(kind: str, x: torch.Tensor, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The activation each scheme's GEMM effectively multiplies, in fp32."""
    if kind == "fp8":
        return dequantize_fp8_act_1x128(*quantize_fp8_act_1x128(x))
    if input_scale is not None:
        return nvfp4_qdq(x.float(), input_scale)
    return x.float()


def load_shards(layer: torch.nn.Module, shards: Sequence[dict[str, torch.Tensor]], merged: bool) -> None:
    """Feed full checkpoint tensors to every parameter's weight loader (shard id = position if merged)."""
    for i, tensors in enumerate(shards):
        for name, t in tensors.items():
            param = getattr(layer, name)
            param.weight_loader(param, t, i if merged else None)


def random_weight(gen: torch.Generator, n: int, k: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(n, k, generator=gen)


def free_port() -> str:
    """A TCP port the OS reports free on 127.0.0.1."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def torchrun_env(rank: int, world: int, master_port: str, gloo: bool = False) -> dict[str, str]:
    """os.environ plus what `torchrun` sets for one rank (one OpenMP thread each); gloo forces the gloo
    backend (k3run.distributed picks NCCL when CUDA is present)."""
    import os

    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": master_port,
        "OMP_NUM_THREADS": "1",
    }
    return os.environ | env | ({"K3RUN_DIST_BACKEND": "gloo"} if gloo else {})


def ranks(size: int) -> list[TPInfo]:
    return [TPInfo(rank=r, size=size) for r in range(size)]


# A KDA-like fused projection: [q | k | g | f_a (replicated) | b], hidden K = 256. q/k/g local sizes stay
# 128-aligned or divide 128 up to tp 8; b = 96 rows (12 per rank at tp 8) shares one 128-row scale block.
KDA_K = 256
KDA_SHARDS = (("q_proj", 512), ("k_proj", 512), ("g_proj", 512), ("f_a_proj", 128), ("b_proj", 96))
KDA_REPLICATED = 3
COL_K, COL_N = 256, 512
ROW_K, ROW_N = 512, 200  # N = 200: FP8 pads to 256


class TPBlock(torch.nn.Module):
    """One column, row and KDA-like merged layer per scheme kind. With `collectives` the column layer
    gathers and the row layer all-reduces; without, each returns its rank-local part (simulated ranks)."""

    def __init__(
        self,
        tp: TPInfo,
        kinds: Sequence[str] = KINDS,
        collectives: bool = True,
        layers: Sequence[str] = ("col", "row", "kda"),
    ) -> None:
        from k3run.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear

        super().__init__()
        self.kinds = tuple(kinds)
        kw = {"tp": tp, "params_dtype": torch.float32, "bias": True}
        for kind in self.kinds:
            if "col" in layers:
                self.add_module(
                    f"col_{kind}",
                    ColumnParallelLinear(
                        COL_K, COL_N, gather_output=collectives, scheme=make_scheme(kind), **kw
                    ),
                )
            if "row" in layers:
                self.add_module(
                    f"row_{kind}",
                    RowParallelLinear(
                        ROW_K,
                        ROW_N,
                        input_is_parallel=False,
                        reduce_results=collectives,
                        scheme=make_scheme(kind),
                        **kw,
                    ),
                )
            if "kda" in layers:
                sizes = [s * tp.size if i == KDA_REPLICATED else s for i, (_, s) in enumerate(KDA_SHARDS)]
                self.add_module(
                    f"kda_{kind}",
                    MergedColumnParallelLinear(
                        KDA_K, sizes, replicated_shard_id=KDA_REPLICATED, scheme=make_scheme(kind), **kw
                    ),
                )


def tp_block_checkpoint(seed: int = 0, kinds: Sequence[str] = KINDS) -> dict[str, torch.Tensor]:
    """Checkpoint tensors for TPBlock (checkpoint names: <layer>.<param>, <kda>.<shard>.<param>)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for kind in kinds:
        for name, (n, k) in (("col", (COL_N, COL_K)), ("row", (ROW_N, ROW_K))):
            for p, t in checkpoint_tensors(kind, random_weight(gen, n, k)).items():
                out[f"{name}_{kind}.{p}"] = t
            out[f"{name}_{kind}.bias"] = torch.randn(n, generator=gen)
        for shard, n in KDA_SHARDS:
            # different amax per shard: NVFP4 global scales differ between the fused shards
            w = random_weight(gen, n, KDA_K, scale=0.5 + len(shard) / 4)
            for p, t in checkpoint_tensors(kind, w).items():
                out[f"kda_{kind}.{shard}.{p}"] = t
            out[f"kda_{kind}.{shard}.bias"] = torch.randn(n, generator=gen)
    return out


def tp_block_mapping(name: str, block: TPBlock | None = None) -> list:
    """Checkpoint name -> targets; with `block`, tensors of layers the block lacks are ignored on purpose."""
    from k3run.loader import IGNORE, Target

    layer, _, rest = name.partition(".")
    if block is not None and not hasattr(block, layer):
        return list(IGNORE)
    if layer.startswith("kda_"):
        shard, _, param = rest.partition(".")
        ids = [s for s, _ in KDA_SHARDS]
        return [Target(f"{layer}.{param}", ids.index(shard))]
    return [Target(name)]


def tp_block_forward(block: TPBlock, seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x_col = torch.randn(3, COL_K, generator=gen)
    x_row = torch.randn(3, ROW_K, generator=gen)
    out = {}
    for kind in block.kinds:
        if hasattr(block, f"col_{kind}"):
            out[f"col_{kind}"] = getattr(block, f"col_{kind}")(x_col)
        if hasattr(block, f"row_{kind}"):
            out[f"row_{kind}"] = getattr(block, f"row_{kind}")(x_row)
        if not hasattr(block, f"kda_{kind}"):
            continue
        kda = getattr(block, f"kda_{kind}")
        for (shard, _), y in zip(KDA_SHARDS, kda.split(kda(x_col)), strict=True):
            out[f"kda_{kind}.{shard}"] = y
    return out
