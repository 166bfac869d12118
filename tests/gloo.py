"""`spawn_gloo`: a function run in several CPU processes joined by a gloo group, for the tensor-parallel
tests (the product's ranks start under torchrun: `k3run.distributed.init_distributed`)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from k3run.distributed import TPInfo, exit_rank


def _function_ref(fn: Callable[..., Any]) -> tuple[str, str, str]:
    """(module name, source file, qualified name): enough to find `fn` again in a fresh process."""
    return fn.__module__, inspect.getfile(fn), fn.__qualname__


def _resolve_function(ref: tuple[str, str, str]) -> Callable[..., Any]:
    module_name, file, qualname = ref
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        # test modules imported by pytest's importlib mode have names that are not on sys.path
        spec = importlib.util.spec_from_file_location(f"_k3run_spawned_{Path(file).stem}", file)
        if spec is None or spec.loader is None:
            raise
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _gloo_worker(
    rank: int, world: int, store_path: str, out_dir: str, fn_ref: tuple[str, str, str], args: tuple[Any, ...]
) -> None:
    torch.set_num_threads(1)
    fn = _resolve_function(fn_ref)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        result = fn(TPInfo(rank=rank, size=world), *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        dist.destroy_process_group()
        raise  # mp.spawn hands this rank's traceback to the parent
    # no barrier: a rank that failed would turn it into a second error here, which mp.spawn can report
    # first in place of the real one; every collective of fn has completed on this rank
    dist.destroy_process_group()
    exit_rank(0)  # the result is on disk


def spawn_gloo(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Run `fn(tp, *args)` in `world_size` fresh CPU processes joined by a gloo group; return the results.

    Rendezvous goes through a FileStore in a private temporary directory, so no TCP port is chosen by us
    (gloo's own data connections use ports the OS hands out). `fn` must be a module-level function (found
    again in the child by module name, or by file for test modules) and its result picklable by torch.save.
    A failure in any rank re-raises here with that rank's traceback.
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="k3run-gloo-") as tmp:
        store_path = str(Path(tmp) / "store")
        try:
            mp.spawn(
                _gloo_worker,
                args=(world_size, store_path, tmp, _function_ref(fn), args),
                nprocs=world_size,
                join=True,
            )
        except mp.ProcessExitedException as e:  # killed by a signal: say how far the ranks got
            done = [r for r in range(world_size) if (Path(tmp) / f"rank{r}.pt").exists()]
            raise RuntimeError(f"{e}; ranks that had written their result: {done or 'none'}") from e
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
