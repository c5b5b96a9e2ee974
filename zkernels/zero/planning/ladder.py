"""The ladder's decision: the lowest rung whose estimate fits a memory budget (pure arithmetic).

``stage="auto"`` (:mod:`zkernels.zero.planning.auto`) and ``python -m zkernels plan`` both decide
here. Rungs, lowest first (``policy.RUNGS``): stage 1, 2, 3, then stage 2 and 3 with offload to
host RAM, then to NVMe. A stage-3 offload rung that does not fit is tried again with
``offload_params`` (the parameter shards in host RAM too: ``param_offload.py``) before the next
rung: it costs host-to-device copies at each gather, not disk bandwidth.
"""
from __future__ import annotations

import inspect
from dataclasses import replace
from typing import List, Optional, Tuple

from .config import QuantizeConfig, ZeroConfig
from .estimate import MemoryEstimate, count_params, estimate_config, estimate_memory
from .policy import RUNGS, STAGES

__all__ = ["RUNGS", "NoRungFitsError", "choose_rung", "ladder_rows", "quantized_choices"]


class NoRungFitsError(RuntimeError):
    """Even the last rung of the ladder needs more memory than the budget."""


def _gb(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.3g} GB"


def ladder_rows(rungs: Tuple[Tuple[int, Optional[str]], ...] = RUNGS,
                offload_params: Optional[bool] = None) -> List[Tuple[int, Optional[str], bool]]:
    """The ladder's rows, lowest first: ``(stage, offload, offload_params)`` for each rung,
    a stage-3 offload rung once without and once with its parameter shards in host RAM.
    ``choose_rung`` tries them in this order; ``plan`` prints one row each (after data
    parallel) and the demo accepts their names.

    Args:
        rungs: ``(stage, offload)`` pairs, lowest first.
        offload_params: None (both rows of a stage-3 offload rung), True (only the rows with
            the parameter shards in host RAM) or False (only those without).
    """
    return [(s, o, op) for s, o in rungs
            for op in ((False, True) if offload_params is None else (offload_params,))
            if not op or (o is not None and STAGES[s].shards_params)]


def quantized_choices(stage: int) -> List[Tuple[Optional[str], Optional[str]]]:
    """``(quantize_weights, quantize_grads)`` pairs worth offering at ``stage`` (ZeRO++'s
    options, see ``zkernels/comm/quantized.py``): int8 and int4 gradients at every ZeRO stage;
    at stage 3 also int8 weights alone and with int4 gradients (ZeRO++'s qwZ + qgZ). They hold
    the same memory as the rung without them and send fewer bytes per step (``plan
    --link-gbps`` shows them with their communication time)."""
    if stage == 0:
        return []
    out: List[Tuple[Optional[str], Optional[str]]] = [(None, "int8"), (None, "int4")]
    if STAGES[stage].shards_params:
        out += [("int8", None), ("int8", "int4")]
    return out


# estimate_memory's keywords that describe the model rather than the run (they pass through).
MODEL_KWARGS = tuple(n for n, p in inspect.signature(estimate_memory).parameters.items()
                     if p.kind is p.KEYWORD_ONLY and n != "config")


def rung_config(base: ZeroConfig, stage: int, offload: Optional[str],
                offload_params: bool) -> ZeroConfig:
    """``base`` on one rung, for its estimate: the memory decision ignores quantization (it
    changes no byte held) and, below stage 3, ``reshard_after_forward`` (nothing to
    reshard)."""
    sharding = base.sharding if STAGES[stage].shards_params else \
        replace(base.sharding, reshard_after_forward=True)
    return replace(base, sharding=sharding, quantization=QuantizeConfig()).at_rung(
        stage, offload, offload_params)


def choose_rung(num_params: int, world_size: int, budget_bytes: int, *,
                config: Optional[ZeroConfig] = None, headroom: float = 0.10,
                host_budget_bytes: Optional[int] = None,
                disk_budget_bytes: Optional[int] = None,
                rungs: Tuple[Tuple[int, Optional[str]], ...] = RUNGS,
                offload_params: Optional[bool] = None, **kwargs,
                ) -> Tuple[Tuple[int, Optional[str]], MemoryEstimate, str]:
    """Lowest rung whose device bytes per rank fit ``budget_bytes * (1 - headroom)``.

    The headroom is left for what the estimate does not count: activations, the allocator's
    fragmentation, the framework's workspace. Activations are the caller's business: a model
    whose activations are large needs a larger headroom or a smaller budget.

    Args:
        num_params: Ψ (or an nn.Module). world_size: N ranks.
        budget_bytes: device memory available to one rank for model states and buffers.
        config: the run's :class:`ZeroConfig` (its stage and offload kind are replaced by
            each rung's); or give its keywords in ``kwargs``.
        headroom: fraction of ``budget_bytes`` kept free, in [0, 1).
        host_budget_bytes, disk_budget_bytes: when given, offload rungs must also fit there.
        rungs: ``(stage, offload)`` pairs to try, lowest first.
        offload_params: None (a stage-3 offload rung is tried without, then with the
            parameter shards in host RAM), True (only with: rungs that cannot take it are
            skipped) or False (never).
        **kwargs: :func:`estimate_memory`'s keywords: the config's (``param_dtype``,
            ``shard_size``, ...; without ``config``) and the model's (``frozen_numel``,
            ``frozen_dtype``, ``max_tensor_numel``, ``num_param_groups``, ...).

    Returns:
        ``((stage, offload), estimate, reason)``: the rung, its estimate (its
        ``offload_params`` says whether the parameter shards go to host RAM), and one sentence
        saying why it was taken (what it needs, what was available, why lower rungs did not fit).

    Raises:
        NoRungFitsError: no rung fits; the message says what the last rung needs.
    """
    model_kw = {k: kwargs.pop(k) for k in MODEL_KWARGS if k in kwargs}
    base = estimate_config("auto", **kwargs) if config is None else \
        estimate_config(None, config, **kwargs)    # raises on keywords beside a config
    if not isinstance(budget_bytes, (int, float)) or budget_bytes < 0:
        raise ValueError(f"budget_bytes must be a number >= 0, got {budget_bytes!r}")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom!r}")
    if not rungs:
        raise ValueError("rungs must name at least one (stage, offload) pair")
    model_or_num = num_params  # a module lets stage 3's estimate count its units
    num_params = count_params(num_params)
    usable = budget_bytes * (1 - headroom)
    where = f"{_gb(usable)} usable of {_gb(budget_bytes)} " \
            f"({headroom:.0%} headroom for activations and fragmentation)"
    rejected = []
    tries = ladder_rows(rungs, offload_params)
    if not tries:
        raise ValueError(f"offload_params=True: none of the rungs {rungs} is stage 3 with "
                         f"offload")
    for stage, offload, op in tries:
        est = estimate_memory(model_or_num, world_size,
                              config=rung_config(base, stage, offload, op), **model_kw)
        misses = []
        if est.device_bytes > usable:
            misses.append(f"{_gb(est.device_bytes)} on the device")
        if host_budget_bytes is not None and est.host_bytes > host_budget_bytes:
            misses.append(f"{_gb(est.host_bytes)} of host RAM > {_gb(host_budget_bytes)}")
        if disk_budget_bytes is not None and est.disk_bytes > disk_budget_bytes:
            misses.append(f"{_gb(est.disk_bytes)} of disk > {_gb(disk_budget_bytes)}")
        if not misses:
            lower = f"; lower rungs need {', '.join(rejected)}" if rejected else ""
            reason = (f"{est.name} is the lowest rung that fits: it needs "
                      f"{_gb(est.device_bytes)} per rank on the device for {num_params:,} "
                      f"params on {world_size} ranks, {where}{lower}")
            return (stage, offload), est, reason
        rejected.append(f"{est.name}: {' and '.join(misses)}")
    raise NoRungFitsError(
        f"no rung of the ladder fits {num_params:,} params on {world_size} ranks in "
        f"{where}: {'; '.join(rejected)}. Use more ranks, a narrower param_dtype, or a "
        f"larger memory budget")
