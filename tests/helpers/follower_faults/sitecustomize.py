"""Put on PYTHONPATH by tests that need a failure on follower ranks alone: in a process started by
multiprocessing's spawn (a follower rank; its command line is ``python -c ...``), every
``Engine.warmup_steps`` fails at its first step, as a fault of that rank alone would."""
import sys

if sys.argv[:1] == ["-c"]:
    import hypic.engine

    def _broken(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("a fault injected on this follower rank alone")
        yield

    hypic.engine.Engine.warmup_steps = _broken
