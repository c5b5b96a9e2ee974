"""Bucketed asynchronous collectives behind one interface (see ``base``)."""
from .base import Comm, Handle

__all__ = ["Comm", "Handle"]
