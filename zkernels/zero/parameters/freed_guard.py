"""A stage-3 parameter read while its unit is freed raises an error that names it, instead of
computing on the empty tensor (0 elements) that stands in for it.

[Note: reading a freed parameter]
While its unit is freed a stage-3 parameter's ``.data`` is empty ([Note: freed parameters are
empty] in ``units.py``), so a read outside its unit's forward and backward (an L2 penalty on
``model.head.weight`` in the training loop, a parent that calls ``F.linear(x,
self.blocks[0].fc.weight)``, a plain ``p.sum()`` between steps) either computed silently on
nothing (shape ``(0,)``, sum 0) or failed deep in torch with a shape error. So on ``free`` the
policy swaps each plain ``nn.Parameter``'s class to :class:`FreedParameter`, whose
``__torch_function__`` raises :class:`FreedParameterError` naming the parameter for every op
except metadata and bookkeeping (attributes such as ``.grad`` / ``.data`` / ``.shape``,
``numel``, hooks, hashing) and moves that return the parameter itself (``model.cpu()`` where
it already is); on ``ensure_gathered`` the class goes back before the data does.
The gathered path is therefore untouched: a gathered parameter is a plain ``nn.Parameter``
(the swap is one attribute store per parameter per gather and free). A parameter of another
class (a subclass with its own ``__torch_function__``) is left as it is, unguarded.
"""
from __future__ import annotations

import torch
import torch.nn as nn

# Ops that read no values: attribute access goes through __get__/__set__ (``.grad``,
# ``.data``, ``.shape``, ``.requires_grad``), the rest is metadata and hook bookkeeping.
_ALLOWED = frozenset({
    "__get__", "__set__", "__hash__", "numel", "nelement", "dim", "ndimension", "size",
    "element_size", "is_floating_point", "is_complex", "requires_grad_",
    "register_hook", "register_post_accumulate_grad_hook", "_is_view", "is_contiguous",
    "get_device", "untyped_storage", "data_ptr", "_has_compatible_shallow_copy_type",
    "stride", "storage_offset", "_typed_storage", "is_sparse", "is_quantized", "is_nested",
    "_is_zerotensor", "is_neg", "is_conj", "_version", "requires_grad",
    "is_inference", "layout", "device", "dtype", "_base", "is_leaf", "grad_fn", "names",
})
# Moves that are no-ops where the parameter already is (``model.cpu()`` on a CPU run, as
# Lightning's teardown does): passed through when they return the parameter itself; a real
# move (another device or dtype) would move the empty stand-in, so it raises.
_NO_OP_MOVES = frozenset({"cpu", "to", "cuda", "type", "float", "contiguous"})


class FreedParameterError(RuntimeError):
    """A stage-3 parameter was read while its unit is freed (its values are sharded)."""


class FreedParameter(nn.Parameter):
    """The class of a freed stage-3 parameter (see [Note: reading a freed parameter]); the
    parameter's ``_zk_sharded`` attribute holds ``(policy, index)`` for the error: the
    policy's ``name`` (its unit) and ``param_names``."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in _ALLOWED:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") in _NO_OP_MOVES and args and \
                isinstance(args[0], FreedParameter):
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **(kwargs or {}))
            if out is args[0]:
                return out
        freed = [a for a in _flat(args, kwargs) if isinstance(a, FreedParameter)]
        policy, i = freed[0]._zk_sharded
        names = getattr(policy, "param_names", ())
        name = names[i] if i < len(names) else f"#{i} of {policy.name}"
        raise FreedParameterError(
            f"stage 3: parameter {name!r} was read ({getattr(func, '__name__', func)}) while "
            f"{policy.name} is freed: outside that unit's forward and backward it holds "
            f"only this rank's shard. Read it inside `with opt.gathered():` (put the forward "
            f"and backward that use it inside too, on every rank: it is collective), or "
            f"make the module that reads it part of the same unit with units=[...]")


def _flat(args, kwargs):
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def guard(params, policy) -> None:
    """Mark ``params`` (``policy``'s, in order) as freed: plain ``nn.Parameter`` s become
    :class:`FreedParameter` (after their ``.data`` went empty)."""
    for i, p in enumerate(params):
        if type(p) is nn.Parameter:
            p._zk_sharded = (policy, i)
            p.__class__ = FreedParameter


def unguard(params) -> None:
    """Before the gathered views go in: back to plain ``nn.Parameter``."""
    for p in params:
        if type(p) is FreedParameter:
            p.__class__ = nn.Parameter
