"""Prefill modes as policy objects: what each reuses, and how.

- ``hypic``: PIC segments cut by HYPIC's seams, cached with (T_C, S_C|0), composed by eq. 6;
  request states kept in the private pool under the request's layout.
- ``naive``: whole segments cached with S_C|0 only, added without transitions (the paper's
  structurally wrong baseline).
- ``prefix``: no segment caching; exact states reused by strict prefix (the usual prefix cache).
- ``full``: no reuse at all.
"""
from dataclasses import dataclass, replace
from enum import StrEnum

from ..errors import InvalidRequest, as_written
from .segments import Seams
from .store import Role


class Mode(StrEnum):
    """A prefill mode's name: parsed once where it comes in (``--mode``, a library call), a plain
    string on the wire (Ray, JSON)."""

    HYPIC = "hypic"
    FULL = "full"
    PREFIX = "prefix"
    NAIVE = "naive"

    @classmethod
    def parse(cls, value: "Mode | str") -> "Mode":
        """``value`` as a ``Mode``; raises ``InvalidRequest`` naming the modes there are."""
        try:
            return cls(value)
        except ValueError:
            raise InvalidRequest(f"mode must be one of {', '.join(MODES)}, got {as_written(value)}") from None


MODES = tuple(mode.value for mode in Mode)


@dataclass(frozen=True)
class ModePolicy:
    """How one prefill mode reuses work."""

    name: Mode
    seams: Seams | None  # how PIC segments are cut; None: segments are not cached
    role: Role  # the kind of public-pool entry it builds and hits
    transitions: bool  # entries carry T_C and compose by eq. 6; else S_C|0 only, composed by addition
    tree: str | None  # its private-pool tree; None: no private-pool reuse
    namespace: str = ""  # the cache namespace its entries and states live in ("": shared by every request)

    @property
    def caches_segments(self) -> bool:
        return self.seams is not None

    def scoped(self, namespace: str) -> "ModePolicy":
        """This policy inside cache ``namespace``: its public entries are keyed with it and its
        private-pool tree is the namespace's own, so nothing is shared with another namespace."""
        if not namespace:
            return self
        return replace(self, namespace=namespace, tree=None if self.tree is None else f"{self.tree}@{namespace}")


def tree_namespace(tree: str) -> str:
    """The cache namespace of a private-pool tree named by ``ModePolicy.scoped`` (mode trees hold no "@")."""
    return tree.partition("@")[2]


def mode_policy(mode: Mode | str, seam_width: int, conv_kernel: int) -> ModePolicy:
    """The policy of ``mode`` for an engine of seam width w on a model of conv width k."""
    match Mode.parse(mode):
        case Mode.HYPIC:
            return ModePolicy(Mode.HYPIC, Seams.for_model(seam_width, conv_kernel), Role.SEGMENT, True,
                              f"hypic:w={seam_width}")
        case Mode.NAIVE:
            return ModePolicy(Mode.NAIVE, Seams(0, 0), Role.NAIVE_SEGMENT, False, "naive")
        case Mode.PREFIX:
            return ModePolicy(Mode.PREFIX, None, Role.SEGMENT, True, "exact")
        case Mode.FULL:
            return ModePolicy(Mode.FULL, None, Role.SEGMENT, True, None)
