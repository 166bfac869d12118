"""Tensor-parallel process groups and the few collectives the model needs (torch.distributed).

Backends: gloo for CPU tensors, NCCL for CUDA tensors. Every collective is an explicit call made by the layer
that needs it (e.g. `RowParallelLinear.forward`), so the communication pattern can be read from the code.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from k3run.knobs import knobs


@dataclass(frozen=True)
class TPInfo:
    """Where this process sits in the tensor-parallel group.

    `group` is the torch.distributed process group of the TP ranks (None = the default world group). With
    size == 1 no collective is ever issued and torch.distributed need not be initialised.
    """

    rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"TPInfo.size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TPInfo.rank must be in [0, {self.size}), got {self.rank}")

    def shard(self, total: int, what: str = "dimension") -> int:
        """Size of this rank's equal share of `total`; raises when `total` does not split evenly."""
        if total % self.size != 0:
            raise ValueError(f"{what} = {total} is not divisible by the tensor-parallel size {self.size}")
        return total // self.size


NO_TP = TPInfo()  # immutable default: a single process, no collectives


def all_reduce(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Sum `x` over the TP group in place and return it (no-op for size 1)."""
    if tp.size == 1:
        return x
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=tp.group)
    return x


def all_gather(x: torch.Tensor, tp: TPInfo, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` in rank order (no-op for size 1)."""
    if tp.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x, group=tp.group)
    return torch.cat(parts, dim=dim)


def init_distributed(backend: str | None = None) -> TPInfo:
    """Join the process group described by the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, ...).

    Without WORLD_SIZE (or with WORLD_SIZE=1) nothing is initialised and TPInfo() is returned. The backend
    is `backend`, else $K3RUN_DIST_BACKEND, else NCCL when CUDA is available and gloo otherwise (a CPU run on
    a machine with GPUs needs gloo: NCCL has no CPU tensors); with NCCL the process binds to LOCAL_RANK's GPU.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return TPInfo()
    rank = int(os.environ["RANK"])
    if backend is None:
        backend = knobs().dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"distributed backend: expected 'nccl' or 'gloo', got {backend!r}")
    device = None
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # device_id binds the NCCL group to this rank's GPU: its barrier (shutdown_distributed's) then runs
        # there, not on a device guessed from the global rank
        dist.init_process_group(backend=backend, rank=rank, world_size=world, device_id=device)
    return TPInfo(rank=rank, size=world, group=None)


def shutdown_distributed() -> bool:
    """Leave the process group cleanly: a barrier so no rank exits while another still talks to it, then
    destroy the group (a gloo rank that exits with the group alive can abort with 'terminate called').
    Returns whether there was a group (this process is a rank)."""
    if not dist.is_initialized():
        return False
    dist.barrier()
    dist.destroy_process_group()
    return True


def exit_rank(code: int) -> NoReturn:
    """End a rank whose work is done and whose group is destroyed, skipping interpreter finalization: a gloo
    rank can still abort there ("terminate called without an active exception", SIGABRT) while its worker
    threads are torn down (pytorch/pytorch#179291 describes the race), turning a correct run into a failed
    one. Logs and standard streams are flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
