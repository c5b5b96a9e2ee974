"""The demo's rungs: data parallel and every row ``python -m zkernels plan`` prints, by name.

A rung is named as ``plan`` prints it ("stage 2 + cpu offload", "stage 3 + cpu offload +
params on host", ...) or by a short key ("ddp", "1", "2+cpu", "3+cpu+params", ...); case and
spaces do not matter. The rows come from the ladder itself (``zero.ladder.ladder_rows``), so a
rung added to the registry is a demo rung too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from ..zero.planning.estimate import rung_name
from ..zero.planning.ladder import ladder_rows

# Every rung the package trains, one each: data parallel, stages 1-3, then one of each
# offload kind (stage 3 + cpu offload with its parameter shards in host RAM too: the last
# step of ZeRO-Offload's ladder before disk). The other rows of plan run with --rungs.
DEFAULT_RUNGS = "ddp,1,2,3,2+cpu,3+cpu+params,2+nvme"


@dataclass(frozen=True)
class Rung:
    """One rung of the demo.

    Attributes:
        stage: 0 (data parallel: DDP + torch.optim.AdamW), 1, 2 or 3.
        offload: None, "cpu" or "nvme".
        offload_params: stage 3 with offload: the parameter shards in host RAM too.
    """

    stage: int
    offload: Optional[str] = None
    offload_params: bool = False
    quantize_weights: Optional[str] = None
    quantize_grads: Optional[str] = None

    @property
    def name(self) -> str:
        """As ``plan`` prints it: 'data parallel', 'stage 3 + cpu offload', ..., then the
        quantized collectives: ' + int8 weights', ' + int4 grads'."""
        return rung_name(self.stage, self.offload, self.offload_params) + "".join(
            f" + {fmt} {what}" for fmt, what in ((self.quantize_weights, "weights"),
                                                 (self.quantize_grads, "grads")) if fmt)

    @property
    def key(self) -> str:
        """Short form: 'ddp', '1', '2+cpu', '3+cpu+params', '3+qw8+qg4', ..."""
        if self.stage == 0:
            return "ddp"
        parts = [str(self.stage)] + ([self.offload] if self.offload else []) + \
            (["params"] if self.offload_params else [])
        if self.quantize_weights:
            parts.append("qw" + self.quantize_weights[3:])
        if self.quantize_grads:
            parts.append("qg" + self.quantize_grads[3:])
        return "+".join(parts)

    @property
    def short(self) -> str:
        """Column label: 'DP', 'S1', 'S3+cpu+params', ..."""
        return "DP" if self.stage == 0 else "S" + self.key


def all_rungs() -> List[Rung]:
    """Data parallel, then the ladder's rows lowest first (the rows of ``plan``)."""
    return [Rung(0)] + [Rung(s, o, op) for s, o, op in ladder_rows()]


def _norm(text: str) -> str:
    return "".join(text.lower().split())


def _lookup() -> Dict[str, Rung]:
    table = {}
    for r in all_rungs():
        table[_norm(r.name)] = table[_norm(r.key)] = r
    table["dp"] = Rung(0)
    return table


def valid_names() -> str:
    """The accepted names, for error messages: 'ddp (data parallel), 1 (stage 1), ...'."""
    return ", ".join(f"{r.key} ({r.name})" for r in all_rungs())


def parse_rungs(text: str, flag: str = "--rungs") -> List[Rung]:
    """A comma list of rung names or keys -> rungs, in the order given.

    Raises:
        ValueError: an empty list, an unknown name (the message lists the valid ones) or a
            rung named twice.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{flag} must list at least one rung, e.g. {DEFAULT_RUNGS}; valid: "
                         f"{valid_names()}")
    table = _lookup()
    out: List[Rung] = []
    for item in text.split(","):
        rung = _quantized(table, item, flag)
        if rung is None:
            raise ValueError(f"{flag}: unknown rung {item.strip()!r} in {text!r}; valid "
                             f"(key or name as plan prints it, comma separated): "
                             f"{valid_names()}")
        if rung in out:
            raise ValueError(f"{flag} lists {rung.name} twice (got {text!r})")
        out.append(rung)
    return out



# The quantized collectives (ZeroOptimizer's quantize_weights / quantize_grads) as suffixes of
# a ZeRO rung's key or name: '3+qw8+qg4', 'stage 2 + int8 grads'.
_QUANT_TOKENS = {"qw8": ("quantize_weights", "int8"), "int8weights": ("quantize_weights", "int8"),
                 "qg8": ("quantize_grads", "int8"), "int8grads": ("quantize_grads", "int8"),
                 "qg4": ("quantize_grads", "int4"), "int4grads": ("quantize_grads", "int4")}


def _quantized(table: Dict[str, Rung], item: str, flag: str) -> Optional[Rung]:
    """The rung ``item`` names, quantization suffixes included (None: unknown).

    Raises:
        ValueError: a quantization on a rung that cannot take it (data parallel; int8 weights
            below stage 3).
    """
    parts = _norm(item).split("+")
    quant = {}
    while len(parts) > 1 and parts[-1] in _QUANT_TOKENS:
        option, fmt = _QUANT_TOKENS[parts.pop()]
        quant.setdefault(option, fmt)
    rung = table.get("+".join(parts))
    if rung is None or not quant:
        return rung
    if rung.stage == 0 or ("quantize_weights" in quant and rung.stage != 3):
        raise ValueError(f"{flag}: {item.strip()!r}: quantized gradients need a ZeRO rung "
                         f"(1, 2, 3) and int8 weights stage 3 (quantize_weights applies to "
                         f"stage 3's parameter gathers)")
    return Rung(rung.stage, rung.offload, rung.offload_params, **quant)
