"""Bucketed asynchronous collectives behind one interface (see ``base``)."""
from .base import CollectiveError, Comm, Handle
from .bucketed import LaunchOrder, ReduceBucket
from .hybrid import HybridComm, make_metered_comm, num_averaged
from .local import LocalComm
from .meter import MeteredComm, VolumeMeter
from .reduce_pool import ReducePool
from .select import make_comm

__all__ = ["CollectiveError", "Comm", "Handle", "LocalComm", "MeteredComm", "VolumeMeter",
           "make_comm", "ReducePool", "LaunchOrder", "ReduceBucket",
           "HybridComm", "make_metered_comm", "num_averaged"]
