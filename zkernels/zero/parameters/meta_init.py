"""Building on the meta device: each unit's meta parameters and buffers materialized, initialized
and (stage 3) sharded before the next unit's exist.

[Note: meta-device build]
A model built under ``torch.device("meta")`` has shapes and dtypes but no storage. With one,
``ZeroOptimizer(model, device=..., param_init=...)`` materializes it unit by unit (the units of
``unit_plan.plan_units``, also at stages 1-2): every meta parameter and buffer registered in the
unit's own modules (those not inside another unit) gets fresh storage on ``device`` in place
(``torch.utils.swap_tensors``: the Parameter objects, so param groups and tied weights, stay the
same objects), filled with NaN (integers with their minimum), then initialized module by module,
children before parents (transformers' ``smart_apply`` order):

- a callable ``param_init(module)``, where given, on each module that had meta tensors;
- else, inside a transformers ``PreTrainedModel``, the nearest such ancestor's
  ``_init_weights(module)`` (what ``initialize_weights`` calls per module; its rotary branch
  recomputes non-persistent ``inv_freq`` buffers);
- else ``module.reset_parameters()`` (what FSDP2 users call after ``to_empty``).

A float tensor still holding a NaN afterwards was not (fully) initialized: that raises a
ValueError naming it, instead of training on uninitialized memory. Stage 3 then copies the unit's
shard out and frees its full parameters before the next unit is materialized; stages 1-2 keep
the full parameters (replicated), only the fp32 state is born sharded.

Initialization does not depend on the world size: every rank materializes a unit's *full*
tensors identically and only then keeps its shard. The random stream is forked per unit and
seeded ``base_seed + unit index`` (index in module order, root last), so the values do not
depend on the order units are built in (stage 3 builds them in backward order) nor on how many
ranks share them; ``base_seed`` is drawn once from the global generator on global rank 0 and
sent to every rank (one all-reduce), so ranks seeded differently (``seed + rank`` for dropout)
still build one model. :func:`materialize_eagerly` builds the same values in one process
(the tests' reference). We differ from FSDP2 (whose ``reset_parameters`` on sharded DTensors
draws from a distributed RNG offset, so values change with the mesh) and from DeepSpeed's
``zero.Init`` (which initializes each parameter at construction and broadcasts rank 0's); like
``zero.Init`` the result does not depend on N. A parameter registered in two units' modules
(hoisted to the root) is initialized by the first unit built that holds it.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from ..planning.unit_plan import UnitSpec, plan_units


def has_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.device.type == "meta" for t in list(model.parameters()) + list(model.buffers()))


def check_meta_args(model: nn.Module, device, param_init) -> Optional[torch.device]:
    """The device to materialize on (None: nothing to materialize).

    Raises:
        TypeError: ``param_init`` neither None nor callable; ``device`` not a device or str.
        ValueError: meta tensors and no ``device``; ``param_init`` or ``device`` given for a
            model with no meta tensor whose parameters are elsewhere; ``device`` meta; real
            parameters on another device than ``device``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if param_init is not None and not callable(param_init):
        raise TypeError(f"param_init must be None or a callable param_init(module), got "
                        f"{type(param_init).__name__}")
    if device is not None:
        if not isinstance(device, (torch.device, str)):
            raise TypeError(f"device must be a torch.device or str, got {type(device).__name__}")
        device = torch.device(device)
        if device.type == "meta":
            raise ValueError("device must be where the model is materialized, got 'meta'")
    meta = has_meta(model)
    if not meta:
        if param_init is not None:
            raise ValueError("param_init= initializes meta-device tensors, but the model has "
                             "none: leave it out for a materialized model")
        real = [p for p in model.parameters()]
        if device is not None and real and real[0].device != device:
            raise ValueError(f"device={device} but the model's parameters are on "
                             f"{real[0].device}; device= is where a meta model is built")
        return None
    if device is None and any(p.device.type != "meta" for p in model.parameters()):
        raise ValueError("the model's parameters are on several devices, some on the "
                         "'meta' device: pass device= (e.g. torch.device('cuda', local_rank) "
                         "or 'cpu') to build the meta ones there, unit by unit (see [Note: "
                         "meta-device build]), or materialize them first")
    if device is None:
        raise ValueError("the model has tensors on the 'meta' device: pass device= (e.g. "
                         "torch.device('cuda', local_rank) or 'cpu') to build it there, unit "
                         "by unit (see [Note: meta-device build])")
    names = {id(t): n for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type != "meta" and t.device != device:
            raise ValueError(f"{names.get(id(t), '?')!r} is on {t.device} but device={device}: "
                             f"a partly materialized model must already be on device")
    return device


def _pretrained_owner(model: nn.Module) -> Dict[int, nn.Module]:
    """``id(module) -> nearest transformers PreTrainedModel enclosing it`` (itself included)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # transformers is optional
        return {}
    out: Dict[int, nn.Module] = {}

    def visit(mod: nn.Module, owner: Optional[nn.Module]) -> None:
        if isinstance(mod, PreTrainedModel):
            owner = mod
        if owner is not None:
            out[id(mod)] = owner
        for child in mod.children():
            visit(child, owner)

    visit(model, None)
    return out


def _post_order(mod: nn.Module, stop: set, out: List[nn.Module]) -> None:
    for child in mod.children():
        if id(child) not in stop:
            _post_order(child, stop, out)
    out.append(mod)


class MetaMaterializer:
    """Materializes ``model``'s meta tensors one unit at a time ([Note: meta-device build]).

    Args:
        model: the model, some tensors on meta.
        device: where they are built.
        param_init: None or ``param_init(module)``.
        specs: ``plan_units(model, ...)`` (module order, root last).
        base_seed: the agreed seed (:func:`agree_seed`).
    """

    def __init__(self, model: nn.Module, device: torch.device, param_init: Optional[Callable],
                 specs: Sequence[UnitSpec], base_seed: int) -> None:
        self.device, self.param_init, self.base_seed = device, param_init, int(base_seed)
        self._owner = _pretrained_owner(model)
        self._names = {id(m): n for n, m in model.named_modules()}
        unit_ids = {id(s.module) for s in specs[:-1]}
        self.specs = list(specs)
        self._modules: Dict[int, List[nn.Module]] = {}
        for s in self.specs:
            mods: List[nn.Module] = []
            _post_order(s.module, unit_ids - {id(s.module)}, mods)
            self._modules[id(s.module)] = mods
        self._index = {id(s.module): i for i, s in enumerate(self.specs)}

    def materialize(self, spec: UnitSpec) -> None:
        """Give ``spec``'s meta tensors storage on the device and initialize them (no-op for a
        unit with none). Raises ValueError naming a tensor left uninitialized or a module with
        meta tensors and no way to initialize them."""
        touched: List[nn.Module] = []
        fresh: Dict[str, torch.Tensor] = {}
        for m in self._modules[id(spec.module)]:
            mine = False
            for store in (m._parameters, m._buffers):
                for key, t in store.items():
                    if t is not None and t.device.type == "meta":
                        self._swap(t)
                        mine = True
                        fresh[f"{self._names.get(id(m), '?')}.{key}".lstrip(".")] = t
            if mine:
                touched.append(m)
        for p in list(spec.params) + list(spec.frozen):  # hoisted from units' modules
            if p.device.type == "meta":
                self._swap(p)
                fresh[f"<hoisted {tuple(p.shape)}>"] = p
        if not fresh:
            return
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(self.base_seed + self._index[id(spec.module)])
            for m in touched:
                self._init(m)
        for name, t in fresh.items():
            if t.is_floating_point() and bool(torch.isnan(t).any()):
                raise ValueError(f"{name} is not fully initialized after materializing unit "
                                 f"{spec.name!r} from the meta device: its module's init left "
                                 f"values unset; pass param_init=callable(module) that sets it")

    def _swap(self, t: torch.Tensor) -> None:
        new = torch.empty(t.shape, dtype=t.dtype, device=self.device)
        if new.is_floating_point():
            new.fill_(float("nan"))
        elif new.dtype != torch.bool:
            new.fill_(torch.iinfo(new.dtype).min)
        if isinstance(t, nn.Parameter):
            new = nn.Parameter(new, requires_grad=t.requires_grad)
        torch.utils.swap_tensors(t, new)

    def _init(self, m: nn.Module) -> None:
        if self.param_init is not None:
            self.param_init(m)
            return
        owner = self._owner.get(id(m))
        if owner is not None:
            owner._init_weights(m)
            return
        reset = getattr(m, "reset_parameters", None)
        if not callable(reset):
            raise ValueError(f"module {self._names.get(id(m)) or '<root>'!r} "
                             f"({type(m).__name__}) holds meta-device tensors but has no "
                             f"reset_parameters(): pass param_init=callable(module) to "
                             f"initialize it")
        reset()


def agree_seed(comm, device: torch.device) -> int:
    """A seed drawn from the global generator on global rank 0, the same on every rank (one
    int64 all-reduce over the data-parallel ranks; with hybrid sharding over the world)."""
    # Down the wrappers (the meter's) to the comm that has the world (hybrid sharding) or to
    # the innermost; HybridComm's own ``inner`` is a new HybridComm each time, so stop at a
    # comm with ``world`` rather than waiting for ``inner`` to return itself.
    world = comm
    while not hasattr(world, "world"):
        nxt = getattr(world, "inner", world)
        if nxt is world:
            break
        world = nxt
    world = getattr(world, "world", world)
    seed = int(torch.randint(0, 2 ** 62, (1,), dtype=torch.int64))
    if world.world_size == 1:
        return seed
    t = torch.tensor([seed if world.rank == 0 else 0], dtype=torch.int64, device=device)
    world.all_reduce(t, op="sum", tag="meta-device build seed").wait()
    return int(t.item())


def materialize_eagerly(model: nn.Module, device, param_init: Optional[Callable] = None,
                        seed: int = 0, units=None) -> nn.Module:
    """Materialize every meta tensor of ``model`` in one process with the values
    ``ZeroOptimizer(model, device=device, param_init=param_init)`` builds from base seed
    ``seed`` (see [Note: meta-device build]); returns ``model``."""
    device = check_meta_args(model, device, param_init)
    if device is None:
        return model
    trainable = [p for p in model.parameters() if p.requires_grad]
    specs = plan_units(model, units, trainable)
    mat = MetaMaterializer(model, device, param_init, specs, seed)
    for s in specs:
        mat.materialize(s)
    return model
