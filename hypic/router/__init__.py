"""Scale-out on Ray: segment-parallel prefill of cold documents, a global segment index, LPT
dispatch and combine-node assembly (installed as ``hypic.router``).

Names are loaded on first use: importing one submodule (``hypic.router.lpt``, say) must not import
Ray, which a server that never scales out would load for nothing (a third of a second a process)."""
import importlib
from typing import Any

_HOMES = {"SegmentIndex": "index", "lpt_assign": "lpt", "makespan": "lpt", "PeerPrefill": "peers", "Plan": "plan",
          "SegmentJob": "plan", "document_jobs": "plan", "make_plan": "plan", "PrefixIndex": "prefix_index",
          "NoLiveWorkers": "router", "RoutedResult": "router", "Router": "router", "TransferError": "transfer",
          "check_entry": "transfer"}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
