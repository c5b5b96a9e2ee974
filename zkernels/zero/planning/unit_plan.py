"""Which modules stage 3 gathers as one unit, and which parameters each unit holds.

[Note: stage-3 units]
A unit is a module whose parameters are gathered with one all-gather before it runs (FSDP2's
``fully_shard`` granularity), never a leaf module (DeepSpeed's per-leaf gathers are its users' top
complaint). By default the units are the children of every ``nn.ModuleList`` / ``nn.Sequential``
whose children are two or more modules of one class that hold parameters (transformer blocks; the
model itself may be such a list), outermost first; ``units=`` names classes (every outermost module
of that class) or module instances instead. Everything else (embeddings, final norm, a head,
parameters registered on the model itself) is the *root* unit: the model, gathered for its whole
forward and its whole backward.

A parameter belongs to the unit that encloses every module registering it. A parameter that
two units register (weights tied across blocks, or a head tied to an embedding held in a unit)
goes to the root unit, which is gathered whenever any unit runs, so sharing is supported
rather than refused. Units do not nest (a unit inside another would put its parameters in
two units): that, a repeated unit, a module that is not part of the model, a class with no
instance in it and a unit with no trainable parameter are errors naming the unit.

There is no persistence threshold: every parameter is sharded, small ones included (a block's
norms and biases ride along in its single all-gather, so they cost no extra collective).
Frozen parameters (``requires_grad=False``) are placed by the same rule (``UnitSpec.frozen``)
and sharded too, in flat units of their own that are gathered with the unit's trainable ones
(see [Note: frozen parameters at stage 3] in ``units.py``): a block whose parameters are all
frozen is a unit like any other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn as nn

ROOT_NAME = "<root>"


@dataclass
class UnitSpec:
    """One unit before its flat buffers exist.

    Attributes:
        name: the module's qualified name (``ROOT_NAME`` for the root).
        module: the module whose forward hooks gather and free it.
        params: its trainable parameters, in ``model.parameters()`` order.
        hoisted: names of parameters that were moved here from the units sharing them.
        frozen: its frozen parameters (``requires_grad=False``), in ``model.parameters()``
            order.
    """

    name: str
    module: nn.Module
    params: List[torch.Tensor] = field(default_factory=list)
    hoisted: List[str] = field(default_factory=list)
    frozen: List[torch.Tensor] = field(default_factory=list)


def _default_unit_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    found: List[Tuple[str, nn.Module]] = []

    def trainable(m: nn.Module) -> bool:  # frozen parameters are sharded too
        return any(True for _ in m.parameters())

    def blocks(mod: nn.Module) -> bool:
        kids = list(mod.children())
        return (isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(kids) >= 2
                and len({type(k) for k in kids}) == 1 and all(trainable(k) for k in kids))

    def visit(prefix: str, mod: nn.Module) -> None:
        if blocks(mod):
            found.extend((f"{prefix}{n}", k) for n, k in mod.named_children())
            return
        for cname, child in mod.named_children():
            visit(f"{prefix}{cname}.", child)

    visit("", model)
    return found


def _explicit_unit_modules(model: nn.Module, units) -> List[Tuple[str, nn.Module]]:
    if isinstance(units, (type, nn.Module)):
        units = [units]
    if not isinstance(units, (list, tuple, set, frozenset)):
        raise TypeError(f"units must be None or a list of nn.Module classes or modules of the "
                        f"model, got {type(units).__name__}")
    name_of: Dict[int, str] = {}
    for n, m in model.named_modules():
        name_of.setdefault(id(m), n)
    chosen: List[Tuple[str, nn.Module]] = []
    for i, u in enumerate(units):
        if isinstance(u, type) and issubclass(u, nn.Module):
            hits = _outermost([(n, m) for n, m in model.named_modules()
                               if isinstance(m, u) and m is not model])
            if not hits:
                present = sorted({type(m).__name__ for m in model.modules()})
                raise ValueError(f"units[{i}]: the model has no module of class "
                                 f"{u.__name__} (its classes: {', '.join(present)})")
            chosen.extend(hits)
        elif isinstance(u, nn.Module):
            if id(u) not in name_of:
                raise ValueError(f"units[{i}] ({type(u).__name__}) is not a submodule of the "
                                 f"model")
            if u is model:
                raise ValueError(f"units[{i}] is the model itself: the model is always the "
                                 f"root unit, list only its submodules")
            chosen.append((name_of[id(u)], u))
        else:
            raise TypeError(f"units[{i}] must be an nn.Module class or a module of the model, "
                            f"got {type(u).__name__}")
    seen: Dict[int, str] = {}
    for n, m in chosen:
        if id(m) in seen:
            raise ValueError(f"units lists module {n!r} twice (its parameters would be in two "
                             f"units)")
        seen[id(m)] = n
    for n, m in chosen:
        if not any(True for _ in m.parameters()):
            raise ValueError(f"unit {n!r} ({type(m).__name__}) holds no parameter: there is "
                             f"nothing to gather, leave it out of units")
    for n, m in chosen:
        for sub_name, sub in m.named_modules():
            if sub is not m and id(sub) in seen:
                raise ValueError(f"unit {seen[id(sub)]!r} is inside unit {n!r}: nested units are "
                                 f"not supported (its parameters would be in two units)")
    return chosen


def _outermost(mods: List[Tuple[str, nn.Module]]) -> List[Tuple[str, nn.Module]]:
    inner: Set[int] = set()
    for _, m in mods:
        for sub in m.modules():
            if sub is not m:
                inner.add(id(sub))
    out, seen = [], set()
    for n, m in mods:
        if id(m) not in inner and id(m) not in seen:
            seen.add(id(m))
            out.append((n, m))
    return out


def plan_units(model: nn.Module, units=None,
               trainable: Optional[Sequence[torch.Tensor]] = None) -> List[UnitSpec]:
    """The units of ``model`` (see [Note: stage-3 units]), in module order, root last.

    Args:
        model: the model.
        units: None (blocks: repeated children of ModuleList/Sequential) or a list of
            ``nn.Module`` classes and/or submodules of ``model``.
        trainable: the trainable parameters (default: those with ``requires_grad``); every
            other parameter of ``model`` is placed as frozen (``UnitSpec.frozen``).

    Returns:
        One :class:`UnitSpec` per unit holding at least one parameter (the root always comes
        last and may be empty).

    Raises:
        ValueError / TypeError: bad ``units`` (the message names the unit).
    """
    mods = _default_unit_modules(model) if units is None else _explicit_unit_modules(model,
                                                                                     units)
    specs = [UnitSpec(n, m) for n, m in mods]
    root = UnitSpec(ROOT_NAME, model)
    index_of = {id(s.module): i for i, s in enumerate(specs)}
    if trainable is None:
        trainable = [p for p in model.parameters() if p.requires_grad]
    grad_ids = {id(p) for p in trainable}
    wanted = {id(p) for p in model.parameters()}
    owners: Dict[int, Set[int]] = {}   # param id -> unit indices registering it (-1: root)
    names: Dict[int, str] = {}

    def walk(mod: nn.Module, prefix: str, unit: int) -> None:
        for pname, p in mod._parameters.items():
            if p is not None and id(p) in wanted:
                owners.setdefault(id(p), set()).add(unit)
                names.setdefault(id(p), f"{prefix}{pname}")
        for cname, child in mod._modules.items():
            if child is None:
                continue
            walk(child, f"{prefix}{cname}.", index_of.get(id(child), unit))

    walk(model, "", -1)
    for p in model.parameters():
        if id(p) not in wanted:
            continue
        where = owners[id(p)]
        kind = "params" if id(p) in grad_ids else "frozen"
        if len(where) == 1 and -1 not in where:
            getattr(specs[next(iter(where))], kind).append(p)
        else:
            getattr(root, kind).append(p)
            if len(where) > 1:
                root.hoisted.append(names[id(p)])
    return [s for s in specs if s.params or s.frozen] + [root]


def unit_numel(spec: UnitSpec) -> int:
    """Elements a unit gathers: its trainable and frozen parameters."""
    return sum(p.numel() for p in spec.params) + sum(p.numel() for p in spec.frozen)


def gathered_peak_numel(model: nn.Module) -> int:
    """Parameters gathered at once at stage 3 with ``reshard_after_forward=True``: the root
    unit plus two of the largest other unit (the one computing and the one prefetched), the
    prefetch bound ``ZeroOptimizer`` uses (padding aside); frozen parameters included."""
    specs = plan_units(model)
    root = unit_numel(specs[-1])
    biggest = max((unit_numel(s) for s in specs[:-1]), default=0)
    return root + 2 * biggest
