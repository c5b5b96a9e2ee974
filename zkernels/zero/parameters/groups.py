"""Which parameters the optimizer manages, in which groups: validated once, up front."""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..planning.optimizer_spec import OptimizerSpec, resolve_optimizer


def resolve_param_groups(model: nn.Module, param_groups: Optional[Sequence[dict]],
                         defaults_of: Callable[[int, dict], dict]) -> List[dict]:
    """Torch-style param groups holding the model's trainable parameters.

    Frozen parameters (``requires_grad=False``) are left out: they are neither sharded nor
    updated. Shared (tied) parameters appear once (``model.parameters()`` deduplicates them).

    Args:
        model: the module being trained (``meta_init.check_meta_args`` checked its type).
        param_groups: None (one group: every trainable parameter), or a list of dicts
            ``{"params": [...], <hyperparameter>: value, ...}`` like torch optimizers take.
        defaults_of: ``(index, user group) -> hyperparameters`` for the keys the group does
            not set (they depend on its own ``"optimizer"``).

    Returns:
        a list of dicts, one per group given, each with ``"params"`` (the group's trainable
        parameters in the user's order; empty where it has none, as torch keeps an empty
        group) and every key of its defaults.

    Raises:
        ValueError: no trainable parameters; a group naming a tensor that is not a parameter
            of ``model`` or naming one twice; a trainable parameter in no group; parameters
            on several devices (dtypes are :func:`resolve_param_dtype`'s).
        TypeError: a malformed ``param_groups``.
    """
    names: Dict[int, str] = {id(p): n for n, p in model.named_parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("model has no trainable parameters (every parameter has "
                         "requires_grad=False): there is nothing to optimize")
    if param_groups is None:
        groups = [{"params": trainable}]
    else:
        groups = _user_groups(param_groups, names)
    seen: Dict[int, int] = {}
    out = []
    for gi, g in enumerate(groups):
        params = [p for p in g["params"] if p.requires_grad]
        for p in params:
            if id(p) in seen:
                raise ValueError(f"parameter {names[id(p)]!r} appears in "
                                 f"param_groups[{seen[id(p)]}] and param_groups[{gi}]: each "
                                 f"parameter belongs to one group")
            seen[id(p)] = gi
        # An empty group (or one of frozen parameters only) stays, as torch.optim keeps it:
        # ``param_groups`` lines up with the user's list (a per-group LambdaLR stays aligned).
        out.append({**defaults_of(gi, g), **{k: v for k, v in g.items() if k != "params"},
                    "params": params})
    missing = [names[id(p)] for p in trainable if id(p) not in seen]
    if missing:
        raise ValueError(f"param_groups leaves out trainable parameters {missing}: add them to "
                         f"a group or set requires_grad=False (an unsynchronized parameter "
                         f"would silently diverge across ranks)")
    _check_devices(trainable, names)
    return out


def _user_groups(param_groups: Sequence[dict], names: Dict[int, str]) -> List[dict]:
    if isinstance(param_groups, dict) or not isinstance(param_groups, (list, tuple)):
        raise TypeError(f"param_groups must be a list of dicts, got {type(param_groups).__name__}")
    groups = []
    for gi, g in enumerate(param_groups):
        if not isinstance(g, dict) or "params" not in g:
            raise TypeError(f"param_groups[{gi}] must be a dict with a 'params' list")
        params = g["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for pi, p in enumerate(params):
            if not isinstance(p, torch.Tensor) or id(p) not in names:
                raise ValueError(f"param_groups[{gi}]['params'][{pi}] is not a parameter of "
                                 f"model (got {type(p).__name__} of shape "
                                 f"{tuple(getattr(p, 'shape', ()))})")
        groups.append({**g, "params": params})
    return groups


def _check_devices(params: Sequence[torch.Tensor], names: Dict[int, str]) -> None:
    # Meta-device parameters are materialized on the optimizer's device= (meta_init.py).
    real = [p for p in params if p.device.type != "meta"]
    if not real:
        return
    device = real[0].device
    for p in real:
        if p.device != device:
            raise ValueError(f"model parameters are on several devices: {names[id(real[0])]!r}"
                             f" is on {device} but {names[id(p)]!r} is on {p.device}; "
                             f"ZeroOptimizer needs every trainable parameter on one device")


# [Note: low-precision models]
# A model whose trainable parameters are all bf16 (or all fp16), as
# ``from_pretrained(..., torch_dtype=torch.bfloat16)`` gives, trains with that dtype as its
# compute dtype: ``param_dtype=None`` means the model's own dtype (FSDP2 also keeps the original
# dtype as the compute dtype), so it is as if ``param_dtype`` had been given. An explicit
# ``param_dtype`` is honoured as for an fp32 model. The fp32 master of each unit is made by
# widening that unit's values as the unit is built (``build_flat_unit`` flattens them into the
# unit's fp32 buffer), one unit at a time: no full fp32 copy of the model ever exists. The
# widened values are exactly the bf16 ones, so a bf16 model trains bit for bit as its
# ``model.float()`` copy does with ``param_dtype=torch.bfloat16``. fp16 goes with the dynamic
# loss scaler, as ``param_dtype=torch.float16`` does. Mixed dtypes among the trainable
# parameters (some fp32, some bf16) have no single compute dtype and are refused by name
# unless ``param_dtype`` says which; other dtypes (float64) are refused. Frozen parameters are
# not consulted (stage 3 keeps them per ``frozen_compute_dtype`` in ``units.py``, whose
# ``param_dtype`` is then the resolved one; stages 1-2 leave them untouched).

LOW_PRECISION = (torch.bfloat16, torch.float16)
_ACCEPTED = (torch.float32,) + LOW_PRECISION


def resolve_param_dtype(params: Sequence[torch.Tensor], names: Dict[int, str],
                        param_dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
    """The compute dtype for trainable ``params`` (see [Note: low-precision models]):
    ``param_dtype`` where given, else the parameters' dtype when they are all bf16 or all
    fp16, else None (fp32).

    Raises:
        ValueError: a parameter that is not fp32, bf16 or fp16; with ``param_dtype`` None,
            trainable parameters of several dtypes (both named).
    """
    for p in params:
        if p.dtype not in _ACCEPTED:
            raise ValueError(f"parameter {names[id(p)]!r} has dtype {p.dtype}; ZeroOptimizer "
                             f"takes float32, bfloat16 or float16 parameters")
    if param_dtype is not None:
        return param_dtype
    first = params[0]
    for p in params:
        if p.dtype != first.dtype:
            raise ValueError(f"trainable parameters have several dtypes: {names[id(first)]!r} "
                             f"is {first.dtype} but {names[id(p)]!r} is {p.dtype}; a "
                             f"low-precision model needs one dtype for every trainable "
                             f"parameter, or pass param_dtype (the compute dtype; each unit's "
                             f"fp32 master is widened from its values)")
    return first.dtype if first.dtype in LOW_PRECISION else None


def frozen_params(model: nn.Module, device: torch.device) -> List[torch.Tensor]:
    """Stage 3: the model's frozen parameters (``requires_grad=False``, tied ones once, in
    ``model.parameters()`` order), which it shards with their unit (see [Note: frozen
    parameters at stage 3] in ``units.py``). A ValueError names one on another device than
    the trainable parameters' ``device`` (meta ones are materialized unit by unit).
    """
    names: Dict[int, str] = {id(p): n for n, p in model.named_parameters()}
    out = [p for p in model.parameters() if not p.requires_grad]
    for p in out:
        if p.device.type != "meta" and p.device != device:
            raise ValueError(f"frozen parameter {names[id(p)]!r} is on {p.device} but the "
                             f"trainable parameters are on {device}: stage 3 shards frozen "
                             f"parameters with their unit, so they must be on the same device")
    return out


def _number(where: str, name: str, value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{where}{name} must be a number, got {value!r}") from None


def check_hparams(where: str, lr, betas, eps, weight_decay) -> None:
    """AdamW's hyperparameters, each named in the error (``where`` prefixes the name, e.g.
    ``"param_groups[1]: "``).

    Raises:
        TypeError: a value that is not a number.
        ValueError: lr, eps or weight_decay below 0, betas not a pair in [0, 1).
    """
    lr, eps, weight_decay = (_number(where, n, v) for n, v in
                             (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)))
    if not float(lr) >= 0.0:
        raise ValueError(f"{where}lr must be >= 0, got {lr}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2
            and all(0.0 <= float(b) < 1.0 for b in betas)):
        raise ValueError(f"{where}betas must be a pair in [0, 1), got {betas!r}")
    if not float(eps) >= 0.0:
        raise ValueError(f"{where}eps must be >= 0, got {eps}")
    if not float(weight_decay) >= 0.0:
        raise ValueError(f"{where}weight_decay must be >= 0, got {weight_decay}")


ADAMW_DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def build_param_groups(model: nn.Module, param_groups: Optional[Sequence[dict]], lr=None,
                       betas=None, eps=None, weight_decay=None, optimizer="adamw",
                       optimizer_kwargs: Optional[dict] = None, elementwise: bool = False
                       ) -> Tuple[List[dict], dict, List[OptimizerSpec]]:
    """``(groups, defaults, specs)``: :func:`resolve_param_groups` with every group's
    hyperparameters checked, and each group's update rule (see [Note: optimizer rules] in
    ``planning/optimizer_spec.py``).

    ``lr``, ``betas``, ``eps``, ``weight_decay``: None is the optimizer's own default (the
    fused AdamW's: 1e-3, (0.9, 0.999), 1e-8, 0.0); given ones go to a torch class as keywords
    beside ``optimizer_kwargs``. A group's ``"optimizer"`` key (a name or a class) gives it
    its own rule, its hyperparameters that class's defaults and the group's keys; the key is
    not kept in the group.
    """
    given = {k: v for k, v in dict(lr=lr, betas=betas, eps=eps,
                                   weight_decay=weight_decay).items() if v is not None}
    kwargs = dict(optimizer_kwargs or {})
    top = resolve_optimizer(optimizer, kwargs if _is_adamw(optimizer) else {**given, **kwargs},
                            elementwise)
    adamw = {**ADAMW_DEFAULTS, **given} if top.fused else dict(ADAMW_DEFAULTS)
    if top.fused:
        check_hparams("", adamw["lr"], adamw["betas"], adamw["eps"], adamw["weight_decay"])
    defaults = {**adamw, "betas": tuple(adamw["betas"])} if top.fused else dict(top.defaults)
    def spec_of(g: dict, where: str) -> OptimizerSpec:
        user = {k: v for k, v in g.items() if k not in ("params", "optimizer")}
        return resolve_optimizer(g["optimizer"], {} if _is_adamw(g["optimizer"]) else user,
                                 elementwise, where=where)

    def defaults_of(gi: int, g: dict) -> dict:
        if "optimizer" not in g:
            return defaults
        spec = spec_of(g, f"param_groups[{gi}]: ")
        return defaults if spec.name == top.name else \
            dict(ADAMW_DEFAULTS) if spec.fused else dict(spec.defaults)

    groups = resolve_param_groups(model, param_groups, defaults_of)
    specs = []
    for i, g in enumerate(groups):
        spec = top
        if "optimizer" in g:
            spec = spec_of(g, f"param_groups[{i}]: ")
            del g["optimizer"]
        if spec.fused:
            check_hparams(f"param_groups[{i}]: ", g["lr"], g["betas"], g["eps"],
                          g["weight_decay"])
        elif param_groups is not None:   # the class checks the group's values
            resolve_optimizer(spec.cls or spec.name, {k: g[k] for k in spec.defaults if k in g},
                              True, where=f"param_groups[{i}]: ")
        specs.append(spec)
    return groups, defaults, specs


def _is_adamw(optimizer) -> bool:
    return isinstance(optimizer, str) and optimizer.lower() == "adamw"


class FrozenAtBuild:
    """The parameters that were frozen when the optimizer was built: they have no flat slot,
    gradient bucket or optimizer state, so one made trainable afterwards would silently never
    train (and at stage 1 its ``.grad`` would grow across ``zero_grad``). :meth:`check` refuses
    that by name at the next ``step()``; the reverse (a trainable parameter frozen mid-run) is
    torch's skip ([Note: unused parameters] in ``gradients/presence.py``).
    """

    def __init__(self, model: nn.Module) -> None:
        seen = set()
        self.params = []
        for n, p in model.named_parameters():
            if not p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self.params.append((n, p))

    def check(self) -> None:
        """Raises:
            RuntimeError: naming the parameters frozen at construction that are trainable now.
        """
        woke = [n for n, p in self.params if p.requires_grad]
        if woke:
            raise RuntimeError(
                f"parameters {woke} became trainable after the ZeroOptimizer was built: it "
                f"lays out, shards and keeps optimizer state only for the parameters trainable "
                f"at construction, so they would never be updated. Build the optimizer again "
                f"(from a checkpoint) with them trainable, or pass them trainable from the "
                f"start (a parameter that should not train for a while can stay trainable: "
                f"a step where it has no gradient skips it, as torch.optim does)")
