"""An in-process stand-in for the part of Ray a ``WorkerPool`` uses, so the pool's deadlines and
locking can be tested without starting Ray: an actor is a plain object (a real
``hypic.router.worker.Worker``, or a stub) whose calls run on a thread pool and come back as
futures; ``get`` and ``wait`` honour their timeouts as Ray's do (``GetTimeoutError``); a call that
raised comes back as a ``RayTaskError``, a killed actor's calls as ``RayActorError``; object refs
passed as arguments are resolved first, as Ray resolves them."""
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from typing import Any

from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError


class FakeRay:
    """``remote``, ``get``, ``wait``, ``put`` and ``kill`` over in-process actors made by
    ``make_actor(cls, *args)`` (default: ``cls(*args)``). ``kill_delay_s``: how long a kill takes."""

    def __init__(self, make_actor: Callable[..., Any] | None = None) -> None:
        self.make_actor = make_actor or (lambda cls, *args: cls(*args))
        self.calls = ThreadPoolExecutor(32, thread_name_prefix="fake-ray-call")
        self.actors: list[Any] = []
        self.killed: list[Any] = []
        self.kill_delay_s = 0.0

    def remote(self, **options: Any) -> Callable[[type], "ActorClass"]:
        return lambda cls: ActorClass(self, cls)

    def get(self, refs: Any, timeout: float | None = None) -> Any:
        if isinstance(refs, list):
            deadline = None if timeout is None else time.monotonic() + timeout
            return [self.get(ref, None if deadline is None else max(0.0, deadline - time.monotonic())) for ref in refs]
        try:
            return refs.result(timeout)
        except FutureTimeout:
            raise GetTimeoutError(f"get timed out after {timeout} s") from None

    def wait(self, refs: list[Future], num_returns: int = 1, timeout: float | None = None) -> tuple[list, list]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            ready = [ref for ref in refs if ref.done()]
            left = None if deadline is None else deadline - time.monotonic()
            if len(ready) >= num_returns or (left is not None and left <= 0):
                break
            wait_futures([ref for ref in refs if not ref.done()], left, FIRST_COMPLETED)
        ready = ready[:num_returns]
        return ready, [ref for ref in refs if ref not in ready]

    def put(self, value: Any) -> Future:
        return _done(value)

    def kill(self, handle: "Handle") -> None:
        time.sleep(self.kill_delay_s)
        handle.dead = True
        self.killed.append(handle.actor)

    def close(self) -> None:
        """Stop the actors' engine loops (real workers) and stop taking calls."""
        for actor in self.actors:
            loop = getattr(actor, "loop", None)
            if loop is not None:
                loop.stop()
        self.calls.shutdown(wait=False, cancel_futures=True)


class ActorClass:
    def __init__(self, ray: FakeRay, cls: type) -> None:
        self.ray, self.cls = ray, cls

    def remote(self, *args: Any) -> "Handle":
        actor = self.ray.make_actor(self.cls, *args)
        self.ray.actors.append(actor)
        return Handle(self.ray, actor)


class Handle:
    """An actor handle: ``handle.method.remote(*args)`` runs ``actor.method(*args)`` on the pool."""

    def __init__(self, ray: FakeRay, actor: Any) -> None:
        self.ray, self.actor, self.dead = ray, actor, False

    def __getattr__(self, name: str) -> "Method":
        return Method(self, name)


class Method:
    def __init__(self, handle: Handle, name: str) -> None:
        self.handle, self.name = handle, name

    def remote(self, *args: Any) -> Future:
        if self.handle.dead:
            failed: Future = Future()
            failed.set_exception(RayActorError())
            return failed
        return self.handle.ray.calls.submit(self._call, args)

    def _call(self, args: tuple[Any, ...]) -> Any:
        try:
            resolved = [arg.result() if isinstance(arg, Future) else arg for arg in args]
            return getattr(self.handle.actor, self.name)(*resolved)
        except Exception as err:
            raise RayTaskError(self.name, traceback.format_exc(), err) from err


class Stall:
    """Calls that block until ``release`` (or the test's end): a worker that never answers."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def __call__(self, *args: Any) -> Any:
        self.released.wait(120)
        raise RuntimeError("released")


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future
