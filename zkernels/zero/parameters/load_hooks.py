"""``model.load_state_dict(...)`` during training reaches the optimizer's shards.

[Note: loading into the model]
The model's parameters are not the state: at stages 1-2 in mixed precision the fp32 master
shards are (the compute copy is rounded from them after every step), and at stage 3 a
parameter has no storage outside a gather, so torch's own load either is undone by the next
step (it restores the old weights from the master) or fails on a (0,)-shaped parameter. The
optimizer registers a load pre-hook and post-hook on the root module, as FSDP2 routes
``load_state_dict`` into its DTensor shards: the pre-hook gathers every stage-3 unit (inside
``opt.gathered()`` they already are; pinned once more), so torch copies the values into full
parameters, and keeps the state dict; the post-hook writes this rank's slice of every loaded
parameter into its fp32 master from the state dict's own values (not the rounded compute
copy), rebuilds the compute shard from it (the checkpoint path's ``write_state``: moments and
step counts are kept, as ``model.load_state_dict`` leaves a torch optimizer's state alone),
writes a frozen stage-3 shard from the loaded values, and then at stages 1-2 re-publishes
the parameters (every rank's full copy follows the masters), at stage 3 frees what the
pre-hook gathered. So the run continues exactly as torch's does after the same load. It is
collective at stage 3 and whenever it loads a trainable parameter: every rank loads the same
keys. Only the root module's ``load_state_dict`` is routed (a submodule's own call is not).
"""
from __future__ import annotations

import contextlib
import weakref

import torch

from .units import remove_hooks


class ModelLoadHooks:
    """The root module's load hooks of one optimizer (held weakly: a dropped optimizer leaves
    no hook behind)."""

    def __init__(self, opt, model: torch.nn.Module) -> None:
        self._opt = weakref.ref(opt)
        self._stack = None
        self._loading = None
        handles = [model.register_load_state_dict_pre_hook(self._pre),
                   model.register_load_state_dict_post_hook(self._post)]
        weakref.finalize(opt, remove_hooks, handles)

    def _pre(self, module, state_dict, prefix, *args) -> None:
        opt = self._opt()
        if opt is None:
            return
        opt.wait_params()   # an in-flight gather would overwrite what is loaded
        self._loading = (state_dict, prefix)
        self._stack = contextlib.ExitStack()
        if opt.schedule is not None:
            self._stack.enter_context(opt.gathered())

    def _post(self, module, incompatible_keys) -> None:
        opt, loading, stack = self._opt(), self._loading, self._stack
        self._loading = self._stack = None
        if opt is None or loading is None:
            return
        with stack, torch.no_grad():
            _write_back(opt, *loading)


def _pieces(unit, state_dict, prefix):
    for name, a, s, n in unit.param_slices_in_shard():
        value = state_dict.get(prefix + name)
        if isinstance(value, torch.Tensor):
            yield value.detach().reshape(-1)[a:a + n], s, n


def _write_back(opt, state_dict, prefix) -> None:
    touched = []
    for u in opt.units:
        pieces = list(_pieces(u, state_dict, prefix))
        if not pieces:
            continue
        z = opt.zero_units[u.index]
        step, (master, exp_avg, exp_avg_sq) = z.read_state()
        for value, s, n in pieces:
            master[s:s + n].copy_(value)
        z.write_state(step, master, exp_avg, exp_avg_sq, z.param_steps)
        touched.append(u)
    for u in opt.frozen_units:   # stage 3: the frozen shards
        pieces = list(_pieces(u, state_dict, prefix))
        if pieces:
            with u.shard_values(write_back=True) as shard:
                for value, s, n in pieces:
                    shard[s:s + n].copy_(value)
    if opt.schedule is None and touched:
        opt.publish(touched)   # stages 1-2: every rank's full copy follows the masters
