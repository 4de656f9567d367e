"""The loop the HTTP app drives is one interface, ``ServingLoop``: the engine loop of one process and
the ingress's face over replicas each define every member of it themselves, methods with the same
parameters (no member borrowed from the other class, none missing)."""
import inspect

import pytest

from hypic.cluster.ingress import ReplicaLoop
from hypic.scheduler.loop import EngineLoop, ServingLoop


def _members() -> dict[str, object]:
    """The protocol's members: its annotated attributes and its methods and properties."""
    found: dict[str, object] = dict.fromkeys(ServingLoop.__annotations__)
    found |= {name: value for name, value in vars(ServingLoop).items()
              if not name.startswith("_") and (callable(value) or isinstance(value, property))}
    return found


@pytest.mark.parametrize("loop", [EngineLoop, ReplicaLoop])
def test_each_serving_loop_has_every_member_of_the_interface(loop: type) -> None:
    members = _members()
    assert {"engine", "snapshot", "alive", "failure", "job_for", "enqueue", "warmup", "flush"} <= set(members)
    init = inspect.getsource(loop.__init__)
    for name, declared in members.items():
        if declared is None:  # an attribute: set by the loop's constructor (or a property of its own)
            assert f"self.{name}" in init or isinstance(getattr(loop, name, None), property), (loop, name)
            continue
        own = inspect.getattr_static(loop, name)
        assert isinstance(own, property) == isinstance(declared, property), (loop, name)
        if callable(declared):
            assert own.__qualname__.split(".")[0] in {c.__name__ for c in loop.__mro__ if c is not object}
            assert own.__qualname__.split(".")[0] != ServingLoop.__name__, (loop, name)
            assert list(inspect.signature(own).parameters) == list(inspect.signature(declared).parameters), (loop, name)


def test_neither_loop_borrows_a_method_of_the_other() -> None:
    for name, value in vars(ReplicaLoop).items():
        assert getattr(value, "__qualname__", "ReplicaLoop").split(".")[0] != "EngineLoop", name
