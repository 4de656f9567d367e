"""Scale-out on Ray: segment-parallel prefill of cold documents, a global segment index, LPT
dispatch and combine-node assembly (installed as ``hypic.router``)."""
from .index import SegmentIndex
from .lpt import lpt_assign, makespan
from .peers import PeerPrefill
from .plan import Plan, SegmentJob, document_jobs, make_plan
from .prefix_index import PrefixIndex
from .router import NoLiveWorkers, RoutedResult, Router
from .transfer import TransferError, check_entry

__all__ = ["NoLiveWorkers", "PeerPrefill", "Plan", "PrefixIndex", "RoutedResult", "Router", "SegmentIndex", "SegmentJob", "TransferError", "check_entry",
           "document_jobs", "lpt_assign", "make_plan", "makespan"]
