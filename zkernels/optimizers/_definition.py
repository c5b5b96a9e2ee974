"""What an element-wise optimizer is, once: its states, hyperparameters and per-step scalars.

[Note: one definition per optimizer]
An element-wise optimizer (each element's update reads only that element's gradient, state and
parameter) is one :class:`ElementwiseOptimizer` object, read by everything else: the ops' checks
and dispatch, the reference, the Triton launch, the C++ binding, the ZeRO rule, the memory
estimate, checkpoints and the config readers. It holds the state buffers (names, dtypes, when
each exists), the hyperparameters (keywords, defaults, checks), the low-bit state forms it
supports, and :meth:`ElementwiseOptimizer.coefficients`, THE per-step signature: a tuple of
Python floats (doubles) that every backend receives and reads by position, rounding each to fp32
once (as torch rounds a Python scalar applied to an fp32 tensor). Booleans travel in it as
0.0/1.0. ``grad_scale``, ``found_inf`` and ``out`` are not in it: they are the step prologue that
every backend shares. The per-element math is written once per backend, in a module named after
the definition: ``zkernels/reference/<name>.py`` (``elementwise``), ``zkernels/kernels/<name>.py``
(``BODY``) and the C++ tile body of ``csrc/``.

This module imports torch and math only: it is the bottom layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, Mapping, Optional, Tuple

import torch

Hparams = Dict[str, object]


def _always(h: Mapping[str, object]) -> bool:
    return True


def _no_cross_check(h: Mapping[str, object]) -> None:
    return None


@dataclass(frozen=True)
class StateSpec:
    """One state buffer: ``name`` (the torch key in checkpoints), its fp32 ``dtype``, and
    ``present(h)``: whether it exists under the resolved hyperparameters ``h``."""

    name: str
    dtype: torch.dtype = torch.float32
    present: Callable[[Mapping[str, object]], bool] = _always


@dataclass(frozen=True)
class HParam:
    """One hyperparameter keyword: ``default`` and ``check(name, value) -> value`` (returns the
    normalized value, e.g. a tuple of floats; raises ValueError naming ``name``)."""

    name: str
    default: object
    check: Callable[[str, object], object]


@dataclass(frozen=True)
class ElementwiseOptimizer:
    """One fused element-wise optimizer (see [Note: one definition per optimizer]).

    Attributes:
        name: the registry key and ``optimizer=`` name ("adamw", "lion", "sgd", "ademamix").
        states: the state buffers in the order every backend takes them.
        hparams: the keywords, with defaults and checks.
        lowbit: the low-bit state forms it supports ("bf16", "int8"); () none.
        lowbit_refused: form -> why it is not supported (named in the error).
        coefficient_names: the names of :meth:`coefficients`' entries, in order.
        needs_step: whether :meth:`coefficients` reads the step (1-based, per parameter).
        cross_check: checks between hyperparameters (``cross_check(h)`` raises ValueError).
        make_coefficients: ``(h, step) -> tuple`` behind :meth:`coefficients`.
        doc: one line for messages and docs.
    """

    name: str
    states: Tuple[StateSpec, ...]
    hparams: Tuple[HParam, ...]
    coefficient_names: Tuple[str, ...]
    make_coefficients: Callable[[Mapping[str, object], int], Tuple[float, ...]]
    lowbit: Tuple[str, ...] = ()
    lowbit_refused: Mapping[str, str] = field(default_factory=dict)
    needs_step: bool = True
    cross_check: Callable[[Mapping[str, object]], None] = _no_cross_check
    doc: str = ""

    @property
    def defaults(self) -> Hparams:
        """Keyword -> default."""
        return {p.name: p.default for p in self.hparams}

    @property
    def state_names(self) -> Tuple[str, ...]:
        return tuple(s.name for s in self.states)

    def resolve(self, where: str = "", **kw) -> Hparams:
        """The hyperparameters with defaults applied and every check run.

        Args:
            where: prefix of error messages (``"param_groups[1]: "``).
            **kw: keywords of :attr:`hparams`.

        Raises:
            TypeError: a keyword the optimizer does not take. ValueError: a value a check
                refuses (the message names the keyword).
        """
        extra = sorted(set(kw) - {p.name for p in self.hparams})
        if extra:
            raise TypeError(f"{where}optimizer={self.name!r} takes "
                            f"{', '.join(p.name for p in self.hparams)}; got unexpected "
                            f"keywords {extra}")
        h: Hparams = {}
        try:
            for p in self.hparams:
                h[p.name] = p.check(p.name, kw.get(p.name, p.default))
            self.cross_check(h)
        except ValueError as exc:
            raise ValueError(f"{where}{exc}") from None
        return h

    def resolve_group(self, group: Mapping[str, object], where: str = "") -> Hparams:
        """:meth:`resolve` of the keywords a param group carries (other keys ignored): the one
        mapping from a group to the op's hyperparameters."""
        return self.resolve(where, **{p.name: group[p.name] for p in self.hparams
                                      if p.name in group})

    def present(self, h: Mapping[str, object]) -> Tuple[bool, ...]:
        """Whether each state buffer exists under ``h`` (in :attr:`states` order)."""
        return tuple(bool(s.present(h)) for s in self.states)

    def state_bytes(self, h: Optional[Mapping[str, object]] = None, form: str = "fp32",
                    block_size: int = 256) -> float:
        """State bytes per trainable element: 4 per present fp32 state, 2 per bf16 one; int8
        (AdamW's blockwise codes) 1 per state plus a 4-byte scale per ``block_size``
        elements (a float then)."""
        n = sum(self.present(self.resolve(**dict(h or {}))))
        self.check_form(form)
        if form == "fp32":
            return 4 * n
        if form == "bf16":
            return 2 * n
        return n * (1 + 4 / block_size)

    def check_form(self, form: str, name: str = "state_dtype") -> None:
        """Raises ValueError unless ``form`` is "fp32" or one of :attr:`lowbit`."""
        if form == "fp32" or form in self.lowbit:
            return
        why = self.lowbit_refused.get(form, "not one of its forms")
        raise ValueError(f"{name}={form!r} is not supported by optimizer={self.name!r}: {why} "
                         f"(supported: fp32{''.join(', ' + f for f in self.lowbit)})")

    def coefficients(self, h: Mapping[str, object], step: int = 1) -> Tuple[float, ...]:
        """The per-step scalars every backend reads by position (doubles; see
        :attr:`coefficient_names`). ``h`` resolved; ``step`` 1-based (ignored unless
        :attr:`needs_step`)."""
        c = tuple(float(x) for x in self.make_coefficients(h, int(step)))
        assert len(c) == len(self.coefficient_names), (self.name, len(c))
        return c


# Checks of hyperparameter values: ``check(name, value) -> value``.

def _real(name: str, x) -> float:
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        raise ValueError(f"{name} must be a real number, got {x!r}")
    return float(x)


def number(name: str, x) -> float:
    """Any real number (not a bool), as a float."""
    return _real(name, x)


def finite(name: str, x) -> float:
    """A finite real number."""
    if not math.isfinite(_real(name, x)):
        raise ValueError(f"{name} must be a finite number, got {x!r}")
    return float(x)


def non_negative(name: str, x) -> float:
    """A finite real number >= 0."""
    if not math.isfinite(_real(name, x)) or x < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {x!r}")
    return float(x)


def flag(name: str, x) -> bool:
    """A bool (or 0/1), as a bool."""
    if isinstance(x, bool) or (isinstance(x, int) and x in (0, 1)):
        return bool(x)
    raise ValueError(f"{name} must be True or False, got {x!r}")


def optional_steps(name: str, x) -> Optional[int]:
    """None or an int >= 1 (a number of steps)."""
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise ValueError(f"{name} must be None or an int >= 1 (steps), got {x!r}")
    return int(x)


def betas(count: int, closed: bool, labels: Tuple[str, ...] = ("beta1", "beta2", "beta3")):
    """A check of ``count`` betas, each in [0, 1] (``closed``) or [0, 1); the message names the
    entry both ways (``betas[0] (beta1)``)."""
    interval = "[0, 1]" if closed else "[0, 1)"

    def check(name: str, x) -> Tuple[float, ...]:
        if not isinstance(x, (tuple, list)) or len(x) != count:
            raise ValueError(f"{name} must be a tuple of {count} numbers in {interval}, "
                             f"got {x!r}")
        for i, b in enumerate(x):
            ok = isinstance(b, (int, float)) and not isinstance(b, bool) and (
                0.0 <= b <= 1.0 if closed else 0.0 <= b < 1.0)
            if not ok:
                raise ValueError(f"{name}[{i}] ({labels[i]}) must be a number in {interval}, "
                                 f"got {b!r}")
        return tuple(float(b) for b in x)
    return check
