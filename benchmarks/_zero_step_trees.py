"""Two zkernels checkouts in one rank (``zero_step.py --baseline-tree DIR``).

[Note: before and after in the same rounds]
On a shared machine two launches, one per checkout, run under different loads, and the load
moves step times by more than any change worth measuring (on this 2-core machine identical
code measured 0.8-1.2x between launches, even as a ratio to DDP in each launch). So each rank
imports zkernels twice: this checkout's, and DIR's beside it, and the baseline's rows
(``zk_stage2@before``) run in the same round-robin as this tree's, step for step.

Python keys modules by name, so the two packages cannot sit in ``sys.modules`` at once.
:class:`Trees` imports each under the name ``zkernels`` and keeps its module objects aside;
``use(label)`` puts one tree's modules into ``sys.modules`` (and takes the other's out) before
every call into a method of that tree: its code then resolves ``import zkernels...`` (at import
time and inside functions) to its own tree. Module globals are bound per module object, so
code of one tree never sees the other's. Both trees' methods go through the same switch (a
dictionary update of their few hundred entries, a few tens of µs, the same for both), so the
switch costs them alike. Limits: a tree's worker threads must not import zkernels modules for
the first time while the other tree is in ``sys.modules`` (zkernels' thread pools run
already-imported code), and a compiled ``_C`` of each tree is loaded from its own path.
"""
from __future__ import annotations

import os
import sys
from typing import Dict

BEFORE = "@before"  # the suffix of a baseline row's name


def _zk_modules() -> Dict[str, object]:
    return {k: v for k, v in sys.modules.items() if k == "zkernels" or k.startswith("zkernels.")}


class Trees:
    """zkernels from several checkouts in one process; ``use(label)`` selects one."""

    def __init__(self) -> None:
        self.mods: Dict[str, Dict[str, object]] = {}
        self.current = None
        self._seen = 0

    def add(self, label: str, root: str) -> str:
        """Import zkernels (and the GPT the benchmark trains) from checkout ``root``.

        Returns:
            The folder the package was imported from.
        """
        self._take_out()
        sys.path.insert(0, root)
        try:
            import zkernels  # noqa: F401 - imported from root: sys.modules was cleared
            import zkernels.demo.model  # noqa: F401
        finally:
            sys.path.remove(root)
        self.mods[label] = _zk_modules()
        self.current = label
        self._seen = len(sys.modules)
        return os.path.dirname(os.path.abspath(self.mods[label]["zkernels"].__file__))

    def _take_out(self) -> None:
        if self.current is not None and len(sys.modules) != self._seen:
            self.mods[self.current].update(_zk_modules())  # submodules imported meanwhile
        for k in (self.mods[self.current] if self.current is not None else _zk_modules()):
            sys.modules.pop(k, None)

    def use(self, label: str) -> None:
        """Put tree ``label``'s modules into ``sys.modules`` (always, so that every call pays
        the same switch)."""
        self._take_out()
        sys.modules.update(self.mods[label])
        self.current = label
        self._seen = len(sys.modules)


class InTree:
    """A method whose every call runs with its tree's zkernels in ``sys.modules``."""

    def __init__(self, trees: Trees, label: str, method) -> None:
        self._trees, self._label, self._method = trees, label, method

    def __getattr__(self, name: str):
        attr = getattr(self._method, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self._trees.use(self._label)
            return attr(*args, **kwargs)

        return call
