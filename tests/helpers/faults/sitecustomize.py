"""Put on PYTHONPATH by tests that inject a fault into a server's processes; ``HYPIC_TEST_FAULT`` says
which. A follower rank is a process started by multiprocessing's spawn (its command line is
``python -c ...``); the server is any other process.

- ``follower_warmup``: on a follower, every ``Engine.warmup_steps`` fails at its first step, as a fault
  of that rank alone would.
- ``follower_record``: a follower reads each request of rank 0's records with one more
  ``max_new_tokens`` than rank 0 sent (a record perturbed on its way).
- ``follower_rows``: a follower's decode steps of two or more rows hand back their logits in reverse
  row order (its samples take each other's tokens).
- ``follower_flush``: a follower's ``Engine.flush`` fails.
- ``follower_clock``: a follower's ``time.perf_counter`` runs 1000 times fast.
- ``follower_generate_exit``: a follower's process exits (status 7) at its first ``Engine.generate``, as
  a rank killed mid-run would.
- ``loop``: in the server, ranking the waiting work raises once a request whose prompt holds
  ``BREAK-THE-LOOP`` waits: a fault of the engine loop itself, owned by no request.
- ``loop_stall``: in the server, ranking the waiting work blocks for good once a request whose prompt
  holds ``STALL-THE-LOOP`` waits: a turn of the loop that never ends (a hung kernel or collective)."""
import os
import sys

FAULT = os.environ.get("HYPIC_TEST_FAULT", "")
ON_FOLLOWER = sys.argv[:1] == ["-c"]


def _follower_warmup() -> None:
    import hypic.engine

    def _broken(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("a fault injected on this follower rank alone")
        yield

    hypic.engine.Engine.warmup_steps = _broken


def _follower_record() -> None:
    import dataclasses

    from hypic.scheduler import lockstep

    real = lockstep.FollowerSync._job

    def _job(self, loop, record):  # type: ignore[no-untyped-def]
        params = dataclasses.replace(record.request.params, max_new_tokens=record.request.params.max_new_tokens + 1)
        return real(self, loop, dataclasses.replace(record, request=dataclasses.replace(record.request, params=params)))

    lockstep.FollowerSync._job = _job


def _follower_rows() -> None:
    import hypic.model_runner

    real = hypic.model_runner.ModelRunner.decode

    def decode(self, states, tokens):  # type: ignore[no-untyped-def]
        logits, states = real(self, states, tokens)
        return (logits.flip(0) if len(tokens) > 1 else logits), states

    hypic.model_runner.ModelRunner.decode = decode


def _follower_flush() -> None:
    import hypic.engine

    def flush(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError("a flush fault injected on this follower rank alone")

    hypic.engine.Engine.flush = flush


def _follower_clock() -> None:
    import time

    real = time.perf_counter
    time.perf_counter = lambda: 1000.0 * real()


def _follower_generate_exit() -> None:
    import hypic.engine

    def generate(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        os._exit(7)

    hypic.engine.Engine.generate = generate


def _loop() -> None:
    from hypic.scheduler import loop

    real = loop.EngineLoop._by_priority

    def _by_priority(self):  # type: ignore[no-untyped-def]
        if any(isinstance(p, loop.Job) and "BREAK-THE-LOOP" in str(p.request.prompt) for p in self.waiting):
            raise RuntimeError("a fault injected into the engine loop")
        return real(self)

    loop.EngineLoop._by_priority = _by_priority


def _loop_stall() -> None:
    import threading

    from hypic.scheduler import loop

    real, never = loop.EngineLoop._by_priority, threading.Event()

    def _by_priority(self):  # type: ignore[no-untyped-def]
        if any(isinstance(p, loop.Job) and "STALL-THE-LOOP" in str(p.request.prompt) for p in self.waiting):
            never.wait()
        return real(self)

    loop.EngineLoop._by_priority = _by_priority


FOLLOWER_FAULTS = {"follower_warmup": _follower_warmup, "follower_record": _follower_record,
                   "follower_rows": _follower_rows, "follower_flush": _follower_flush, "follower_clock": _follower_clock,
                   "follower_generate_exit": _follower_generate_exit}
if FAULT in FOLLOWER_FAULTS and ON_FOLLOWER:
    FOLLOWER_FAULTS[FAULT]()
elif FAULT == "loop" and not ON_FOLLOWER:
    _loop()
elif FAULT == "loop_stall" and not ON_FOLLOWER:
    _loop_stall()
