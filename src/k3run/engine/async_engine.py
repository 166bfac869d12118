"""`AsyncEngine`: one `LLMEngine` stepped on a background thread for many asyncio clients (continuous
batching), and its tensor-parallel mirror `follow`.

The thread takes new requests and aborts from thread-safe queues, steps the engine while anything is
unfinished and hands each output to its request's asyncio queue, so callers never wait on a model step. A
request that cannot run gets an exception in its queue instead: `RequestRefused` when the engine rejects it
(a ValueError from `add_request`: the caller's input), `RequestFailed` when adding it or a model step raised
(a failed step fails every request then in flight; the loop goes on).

Under tensor parallelism rank 0 runs the `AsyncEngine` and broadcasts each iteration's `Command` (its adds,
aborts and stop flag); every other rank runs `follow`, which applies the same commands and steps, so all
ranks keep identical schedules.
"""

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from k3run.engine.llm import LLMEngine
from k3run.engine.sequence import RequestOutput, SamplingParams

log = logging.getLogger(__name__)


class RequestRefused(ValueError):
    """The engine refused the request (its `add_request` raised a ValueError: the request's own fault)."""


class RequestFailed(RuntimeError):
    """Adding the request, or a model step while it was in flight, failed on the engine's side."""


@dataclass
class AsyncRequest:
    key: int
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # RequestOutput, or the exception ending it
    rid: int | None = None  # the engine's id, once the engine thread has added it


Command = tuple[list[tuple[int, list[int], SamplingParams]], list[int], bool]  # (adds, aborts, stop)


def apply_command(engine: LLMEngine, rids: dict[int, int], cmd: Command) -> dict[int, Exception]:
    """Apply one step's new requests and aborts to `engine` (the same on every tensor-parallel rank, so all
    ranks keep identical schedules); `rids` maps request keys to engine ids. Returns the adds that failed."""
    adds, aborts, _ = cmd
    errors: dict[int, Exception] = {}
    for key, ids, params in adds:
        try:
            rids[key] = engine.add_request(ids, params)
        except Exception as e:  # whatever one request's add raises concerns that request alone
            if not isinstance(e, ValueError):
                log.exception("adding request %d failed", key)
            errors[key] = e
    for key in aborts:
        rid = rids.pop(key, None)
        if rid is not None:
            engine.abort(rid)
    return errors


def _broadcast(cmd: Command | None) -> Command:
    import torch.distributed as dist

    box = [cmd]
    dist.broadcast_object_list(box, src=0)
    got = box[0]
    if got is None:
        raise RuntimeError("tensor parallelism: rank 0 broadcast no command")
    return got


def follow(engine: LLMEngine) -> None:
    """A tensor-parallel rank other than 0: mirror rank 0's requests and steps until it stops."""
    rids: dict[int, int] = {}
    while True:
        cmd = _broadcast(None)
        if cmd[2]:
            return
        apply_command(engine, rids, cmd)
        if engine.has_unfinished():
            finished = {o.request_id for o in engine.step() if o.finished}
            if finished:
                for key in [k for k, r in rids.items() if r in finished]:
                    del rids[key]


class AsyncEngine:
    """Runs `engine` on a background thread; `submit` / `abort` are safe from any thread.

    With `tensor_parallel`, this is rank 0: every iteration broadcasts its new requests and aborts (an empty
    command at least once a second while idle, so the other ranks' collectives never time out) and the
    other ranks run `follow`. `on_step_failure`, if set, is called (on the engine thread) for each model
    step that raises.
    """

    def __init__(self, engine: LLMEngine, tensor_parallel: bool = False) -> None:
        self.engine = engine
        self.tensor_parallel = tensor_parallel
        self._keys = itertools.count()
        self._new: deque[AsyncRequest] = deque()
        self._aborts: deque[int] = deque()
        self._live: dict[int, AsyncRequest] = {}  # key -> request, touched by the engine thread only
        self._by_rid: dict[int, AsyncRequest] = {}
        self._rids: dict[int, int] = {}  # key -> engine id
        self._wake = threading.Event()
        self._stop = False
        self._step_started: float | None = None  # time.monotonic() of the step running now, if any
        self.on_step_failure: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._run, name="k3run-engine", daemon=True)
        self._thread.start()

    def health(self, stall_s: float) -> str | None:
        """None when the engine thread is alive and no step has run longer than `stall_s`; else why not."""
        if not self._thread.is_alive():
            return "the engine thread has stopped"
        started = self._step_started
        if started is not None and time.monotonic() - started > stall_s:
            return f"one engine step has run for {time.monotonic() - started:.0f} s (limit {stall_s:g} s)"
        return None

    def counts(self) -> tuple[int, int]:
        """(running, waiting) sequences of the engine's scheduler."""
        sched = self.engine.scheduler
        return len(sched.running), len(sched.waiting)

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> AsyncRequest:
        req = AsyncRequest(next(self._keys), prompt_ids, params, asyncio.get_running_loop())
        self._new.append(req)
        self._wake.set()
        return req

    def abort(self, req: AsyncRequest) -> None:
        self._aborts.append(req.key)
        self._wake.set()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _deliver(self, req: AsyncRequest, item: RequestOutput | BaseException) -> bool:
        try:
            req.loop.call_soon_threadsafe(req.queue.put_nowait, item)
            return True
        except RuntimeError:  # the request's event loop has closed, and its client with it
            return False

    def _forget(self, req: AsyncRequest) -> None:
        self._live.pop(req.key, None)
        self._rids.pop(req.key, None)
        if req.rid is not None:
            self._by_rid.pop(req.rid, None)

    def _run(self) -> None:
        while True:
            try:
                if self._iteration():
                    return
            except Exception as e:  # the engine thread must outlive any one request's failure
                log.exception("engine loop error")
                self._fail_in_flight(f"engine error: {e}")

    def _fail_in_flight(self, message: str) -> None:
        """A RequestFailed to every request the engine holds; each is aborted through the next command, so
        every tensor-parallel rank drops it."""
        for req in list(self._live.values()):
            self._deliver(req, RequestFailed(message))
            self._aborts.append(req.key)

    def _iteration(self) -> bool:
        """Take new requests and aborts, then one engine step (or a short wait when idle). True: stopped."""
        adds = [self._new.popleft() for _ in range(len(self._new))]
        aborts = [self._aborts.popleft() for _ in range(len(self._aborts))]
        cmd: Command = ([(r.key, r.prompt_ids, r.params) for r in adds], aborts, self._stop)
        if self.tensor_parallel:
            _broadcast(cmd)
        if self._stop:
            return True
        errors = apply_command(self.engine, self._rids, cmd)
        for req in adds:
            if req.key in errors:
                e = errors[req.key]
                if isinstance(e, ValueError):
                    self._deliver(req, RequestRefused(str(e)))
                else:
                    self._deliver(req, RequestFailed(f"adding the request failed: {e}"))
                continue
            req.rid = self._rids[req.key]
            self._live[req.key] = req
            self._by_rid[req.rid] = req
        for key in aborts:
            aborted = self._live.get(key)
            if aborted is not None:
                self._forget(aborted)
        if not self.engine.has_unfinished():
            self._wake.wait(timeout=1.0)
            self._wake.clear()
            return False
        self._step_started = time.monotonic()
        try:
            outs = self.engine.step()
        except Exception as e:  # a failed step fails every request in flight; the loop goes on
            log.exception("model step failed")
            if self.on_step_failure is not None:
                self.on_step_failure()
            self._fail_in_flight(f"model step failed: {e}")
            return False
        finally:
            self._step_started = None
        for out in outs:
            owner = self._by_rid.get(out.request_id)
            if owner is None:
                continue
            delivered = self._deliver(owner, out)
            if out.finished:
                self._forget(owner)
            elif not delivered:
                self._aborts.append(owner.key)
        return False
