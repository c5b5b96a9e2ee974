"""The "cpp" backend of ``zkernels.ops``: the native CPU kernels of ``zkernels._C``.

Importing this module never fails: ``AVAILABLE`` says whether the extension loaded. Only ops
implemented natively are defined here (the dispatcher checks ``hasattr``). ``ZKERNELS_CPU_ISA``
(``auto``/``scalar``/``avx2``/``avx512``) forces a SIMD path; it is read at call time, here at
the binding boundary, never deeper.

[Note: which CPU ops are native]
Every fused op runs natively on CPU tensors, because none of them can beat its PyTorch peer as
a composition of torch calls, which is all the reference can be while it stays the oracle:

- flatten / unflatten / bucket_pack / bucket_unpack: the peers are ``torch.cat`` and
  ``torch._foreach_copy_`` (+ ``_foreach_mul``), each already one C++ loop over the tensors;
  a reference built from the same calls can only add Python work on top, and the bucket peers
  make an fp32 temporary that the fused copy-scale-cast never writes (6 bytes per element
  instead of 14). Native: one pass. The public ops and OpSet first offer each call to a
  checked native fast path (``CHECKED_COPY``, [Note: checked fast path of the copy ops] in
  python/src/cpu_ops.cpp), which reads each tensor through torch's stable C shim (~0.06 us a
  tensor; torch's getters, ~0.17 us, where the shim is missing or a torch-function mode is
  active) instead of the Python checks plus binding (~0.6 us a tensor and ~4 us a call).
  flatten's copy runs at the speed of ``torch.cat``'s (both are plain copies at the machine's
  copy bandwidth), so the per-tensor reads decide it: ``torch.cat`` spends ~0.11 us per tensor
  in C++, the shim reads half that, so flatten is ahead of it at every size (with the getters
  it was 0.93-0.97x at 256K in 32 tensors on 1 thread).
- cast: ``out.copy_(x)`` is the peer and the reference; only a leaner call can be faster.
- unscale_and_check_: the reference is two passes plus an fp32 temporary (``isfinite().all()``,
  ``x.float().mul``), the peer one fused pass; native does the fused pass (its checks in C
  too: ``CHECKED_UNSCALE``).
- sum_squares: the reference is one torch reduction per tensor; native is one pass over all of
  them, in an fp64 order that is the same on every path and thread count ([Note: sum_squares
  order] in csrc/cpu_ops/kernel.h), so it equals the reference exactly where fp32 is exact
  and is within the tolerance table elsewhere.
- adamw_step: native (csrc/cpu_adam), one fused pass in its own operation order, so it is
  within the fp32 tolerance table of the reference, not bit for bit (tests/ops/test_adamw.py,
  tests/native/test_cpu_adam.py); its bf16/fp16 parameter copy is torch's cast bit for bit.
  Both take the IEEE sqrt ([Note: correctly rounded sqrt] in zkernels/reference/adamw.py);
  the moments already differ in last bits (its lerp and ``v`` update are unrounded products
  and sums where torch's kernels fuse a multiply-add, it multiplies by ``1/grad_scale`` and
  ``1/sqrt(1-beta2^t)`` where the reference divides, and forms ``step_size * (m / denom)``).
- adamw_step_lowbit: native (csrc/cpu_adam_lowbit), one pass with each block staged in L1;
  the reference dequantizes, steps and requantizes whole buffers, a dozen passes with their
  fp32 temporaries. It fuses where torch's CPU kernels fuse and takes the correctly rounded
  sqrt the reference takes, so it is bit-exact with the reference ([Note: lowbit arithmetic
  is torch's] in csrc/cpu_adam_lowbit/kernel.h).
- the element-wise optimizers (lion, sgd, ademamix: ``optimizer_step``): native (csrc/optim, one
  tile body per definition), one pass; the reference is several torch ops each with its fp32
  temporary. Bit-exact with the reference for power-of-two (or no)
  ``grad_scale``: the native paths multiply by ``1/grad_scale`` as cpu_adam does.
- quantize / dequantize / dequantize_sum: the reference is a chain of torch ops over whole
  buffers (pad, bit views, amax, divide, round, where, pack; or unpack, repeat_interleave,
  multiply, add per chunk), each a pass over memory with its temporary; native is one pass
  per block, staged in L1 (csrc/cpu_quant), bit-exact with the reference on every path.

The reference stays the plain oracle the tests compare every path with, bit for bit for every
copy and cast (tests/ops with ``ZKERNELS_BACKEND=cpp``, tests/native/test_cpu_ops.py per ISA,
tests/native/test_checked_copy.py for the checked fast paths through the public ops).
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple, Union

import torch

from .optimizers import LION, SGD

try:
    from . import _C
except ImportError as _exc:  # no extension built: the reference backend runs instead
    _C = None
    IMPORT_ERROR: Optional[ImportError] = _exc
else:
    IMPORT_ERROR = None

AVAILABLE = _C is not None

# The native copy and unscale with every check of zkernels.ops done inside them, declining
# (False) what they do not take: zkernels.ops tries them first on CPU tensors (ops/_fast.py;
# [Note: checked fast path of the copy ops] in python/src/cpu_ops.cpp).
CHECKED_COPY = _C.cpu_copy_checked if _C is not None else None
CHECKED_UNSCALE = _C.cpu_unscale_checked if _C is not None else None

# The definitions (zkernels.optimizers names) whose tile body csrc/optim implements: the ops
# dispatcher picks this backend's optimizer_step for a definition only when it is in here.
OPTIMIZER_KINDS = frozenset(_C.cpu_optimizer_kinds()) if _C is not None else frozenset()

Scalar = Union[float, int, torch.Tensor]


def _value(x: Scalar) -> float:
    # step/grad_scale live on the host next to CPU shards: reading them costs no device sync.
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def _isa() -> str:
    return os.environ.get("ZKERNELS_CPU_ISA", "auto").strip().lower() or "auto"


# The list and copy ops pass ``isa=None``: their binding reads ZKERNELS_CPU_ISA itself with
# getenv (which sees every os.environ change: Python mirrors them with putenv), the same value
# at the same moment, ~1 us cheaper per call than os.environ (see [Note: cheap checks]).
_ENV_ISA = None


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, *, lr: float, beta1: float, beta2: float, eps: float,
               weight_decay: float = 0.0, step: Scalar, decoupled: bool = True,
               grad_scale: Optional[Scalar] = None, found_inf: Optional[torch.Tensor] = None,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One AdamW update in place, natively, in a single pass over memory: grad read as
    fp32/bf16/fp16, unscaled, AdamW applied, and the updated params written to ``out``
    (fp32/bf16/fp16, round to nearest even) in the same loop. Arguments and result as
    :func:`zkernels.reference.adamw_step`; CPU tensors only.

    Args:
        param, exp_avg, exp_avg_sq: contiguous fp32 CPU buffers of n elements.
        grad: contiguous fp32/bf16/fp16 CPU buffer of n elements.
        step, grad_scale: numbers or 1-element CPU tensors (read on the host).
        found_inf: optional fp32 1-element CPU tensor; nonzero skips the step entirely.
        out: optional contiguous CPU buffer of n elements (fp32/bf16/fp16).

    Returns:
        ``param``.
    """
    if _C is None:
        raise RuntimeError(f"zkernels._C is not built: {IMPORT_ERROR}")
    _C.cpu_adamw_step(
        param, grad, exp_avg, exp_avg_sq, lr=float(lr), beta1=float(beta1),
        beta2=float(beta2), eps=float(eps), weight_decay=float(weight_decay),
        step=_value(step), decoupled=bool(decoupled),
        grad_scale=1.0 if grad_scale is None else _value(grad_scale),
        found_inf=found_inf, out=out, isa=_isa(), num_threads=torch.get_num_threads())
    return param


def adamw_step_lowbit(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                      exp_avg_sq: torch.Tensor, exp_avg_scales: Optional[torch.Tensor] = None,
                      exp_avg_sq_scales: Optional[torch.Tensor] = None, *, lr: float,
                      beta1: float, beta2: float, eps: float, weight_decay: float = 0.0,
                      step: Scalar, decoupled: bool = True,
                      grad_scale: Optional[Scalar] = None,
                      found_inf: Optional[torch.Tensor] = None,
                      out: Optional[torch.Tensor] = None, block_size: int = 256) -> torch.Tensor:
    """One AdamW update over bf16 or blockwise int8 moments in place, natively, in one pass
    (csrc/cpu_adam_lowbit: dequantize, update, requantize per block in L1), the operations of
    :func:`zkernels.reference.adamw_step_lowbit` ([Note: lowbit arithmetic is torch's] in
    csrc/cpu_adam_lowbit/kernel.h). Arguments and result as the reference; CPU tensors only,
    ``step`` and ``grad_scale`` numbers or 1-element CPU tensors (read on the host)."""
    _need_ext()
    _C.cpu_adamw_step_lowbit(
        param, grad, exp_avg, exp_avg_sq, exp_avg_scales, exp_avg_sq_scales, lr=float(lr),
        beta1=float(beta1), beta2=float(beta2), eps=float(eps),
        weight_decay=float(weight_decay), step=_value(step), decoupled=bool(decoupled),
        grad_scale=1.0 if grad_scale is None else _value(grad_scale), found_inf=found_inf,
        out=out, block_size=int(block_size), isa=_isa(), num_threads=torch.get_num_threads())
    return param


def optimizer_step(defn, param: torch.Tensor, grad: torch.Tensor,
                   states: Sequence[Optional[torch.Tensor]], coeffs: Sequence[float], *,
                   grad_scale: Optional[Scalar] = None, found_inf: Optional[torch.Tensor] = None,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One step of an element-wise optimizer in place, natively, in one pass (csrc/optim: the
    definition's C++ tile body, every path bit for bit the same).

    Args:
        defn: the definition (``zkernels.optimizers`` entry; its ``name`` is the C++ kind) or
            that name.
        param: contiguous fp32 CPU buffer of n elements.
        grad: contiguous fp32/bf16/fp16 CPU buffer of n elements.
        states: the definition's state buffers in its order (fp32, n elements; None where
            the state is absent).
        coeffs: ``defn.coefficients(h, step)``.
        grad_scale: number or 1-element CPU tensor (read on the host); the gradient is
            multiplied by fp32(1 / grad_scale).
        found_inf: optional fp32 1-element CPU tensor; nonzero skips the step entirely.
        out: optional contiguous CPU buffer of n elements (fp32/bf16/fp16) receiving the
            updated params, rounded to nearest even.

    Returns:
        ``param``.

    Raises:
        ValueError: an unknown kind, a wrong number of states or coefficients, a missing
            state or a bad argument (named), from the binding.
    """
    _need_ext()
    _C.cpu_optimizer_step(
        getattr(defn, "name", defn), param, grad, list(states), [float(c) for c in coeffs],
        grad_scale=1.0 if grad_scale is None else _value(grad_scale), found_inf=found_inf,
        out=out, isa=_isa(), num_threads=torch.get_num_threads())
    return param


def lion_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, *, lr: float,
              beta1: float = 0.9, beta2: float = 0.99, weight_decay: float = 0.0,
              grad_scale: Optional[Scalar] = None, found_inf: Optional[torch.Tensor] = None,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`zkernels.reference.lion_step` through :func:`optimizer_step` and the definition
    (kept for the callers of the per-optimizer name)."""
    h = LION.resolve(lr=lr, betas=(beta1, beta2), weight_decay=weight_decay)
    return optimizer_step(LION, param, grad, (exp_avg,), LION.coefficients(h),
                          grad_scale=grad_scale, found_inf=found_inf, out=out)


def sgd_step(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: Optional[torch.Tensor],
             *, lr: float, momentum: float = 0.0, dampening: float = 0.0,
             weight_decay: float = 0.0, nesterov: bool = False, step: Scalar,
             grad_scale: Optional[Scalar] = None, found_inf: Optional[torch.Tensor] = None,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`zkernels.reference.sgd_step` through :func:`optimizer_step` and the definition
    (kept for the callers of the per-optimizer name)."""
    h = SGD.resolve(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                    nesterov=bool(nesterov))
    return optimizer_step(SGD, param, grad, (momentum_buffer,),
                          SGD.coefficients(h, int(_value(step))), grad_scale=grad_scale,
                          found_inf=found_inf, out=out)


def _threads() -> int:
    return torch.get_num_threads()


def _need_ext() -> None:
    if _C is None:
        raise RuntimeError(f"zkernels._C is not built: {IMPORT_ERROR}")


def _back_to_back(numels: Sequence[int]) -> List[int]:
    out, pos = [], 0
    for n in numels:
        out.append(pos)
        pos += int(n)
    return out


def flatten(tensors: Sequence[torch.Tensor], *, out: Optional[torch.Tensor] = None,
            dtype: Optional[torch.dtype] = None,
            offsets: Optional[Sequence[int]] = None) -> torch.Tensor:
    """:func:`zkernels.reference.flatten` natively: one pass, cast to ``out.dtype``.

    Arguments as checked by :func:`zkernels.ops.flatten` (CPU, contiguous, one dtype)."""
    _need_ext()
    if offsets is None or out is None:
        numels = [t.numel() for t in tensors]
        offsets = _back_to_back(numels) if offsets is None else offsets
    if out is None:
        total = max((int(o) + n for o, n in zip(offsets, numels)), default=0)
        out = torch.zeros(total, dtype=dtype or (tensors[0].dtype if tensors else torch.float32))
    _C.cpu_copy_segments(tensors, out, offsets, True, 1.0, False, _ENV_ISA, _threads())
    return out


def unflatten(flat: torch.Tensor, shapes: Optional[Sequence[Sequence[int]]] = None, *,
              out: Optional[Sequence[torch.Tensor]] = None,
              offsets: Optional[Sequence[int]] = None) -> List[torch.Tensor]:
    """:func:`zkernels.reference.unflatten` natively (``out=``: one pass, cast to the outputs'
    dtype; ``shapes=``: views, no copy)."""
    if (shapes is None) == (out is None):
        raise ValueError("unflatten: give exactly one of shapes= or out=")
    if shapes is not None:
        numels = [int(torch.Size(s).numel()) for s in shapes]
        offs = list(offsets) if offsets is not None else _back_to_back(numels)
        return [flat[o:o + n].view(tuple(s)) for s, o, n in zip(shapes, offs, numels)]
    _need_ext()
    if offsets is None:
        offsets = _back_to_back([t.numel() for t in out])
    _C.cpu_copy_segments(out, flat, offsets, False, 1.0, False, _ENV_ISA, _threads())
    return list(out)


def bucket_pack(tensors: Sequence[torch.Tensor], bucket: torch.Tensor, offsets: Sequence[int], *,
                scale: float = 1.0) -> torch.Tensor:
    """:func:`zkernels.reference.bucket_pack` natively: scale and cast in the one copy."""
    _need_ext()
    _C.cpu_copy_segments(tensors, bucket, offsets, True, scale, True, _ENV_ISA, _threads())
    return bucket


def bucket_unpack(bucket: torch.Tensor, outs: Sequence[torch.Tensor], offsets: Sequence[int], *,
                  scale: float = 1.0) -> Sequence[torch.Tensor]:
    """:func:`zkernels.reference.bucket_unpack` natively: scale and cast in the one copy."""
    _need_ext()
    _C.cpu_copy_segments(outs, bucket, offsets, False, scale, True, _ENV_ISA, _threads())
    return outs


def cast(x: torch.Tensor, dtype: Optional[torch.dtype] = None, *,
         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`zkernels.reference.cast` natively (``x.to(dtype)`` bit for bit)."""
    _need_ext()
    if out is None:
        out = torch.empty(x.shape, dtype=dtype)
    _C.cpu_copy_segments((x,), out, (0,), True, 1.0, False, _ENV_ISA, _threads())
    return out


def unscale_and_check_(x: torch.Tensor, inv_scale: Union[float, torch.Tensor],
                       found_inf: torch.Tensor) -> torch.Tensor:
    """:func:`zkernels.reference.unscale_and_check_` natively: check and multiply in one pass
    (``inv_scale`` as a tensor is read on the host: CPU tensors need no device sync)."""
    _need_ext()
    _C.cpu_unscale_and_check(x, inv_scale, found_inf, _ENV_ISA, _threads())
    return found_inf


def quantize(x: torch.Tensor, *, bits: int = 8, block_size: int = 256,
             out: Optional[torch.Tensor] = None,
             scales: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`zkernels.reference.quantize` natively: one pass per block (csrc/cpu_quant)."""
    _need_ext()
    n = x.numel()
    if out is None:
        out = torch.empty(n if bits == 8 else (n + 1) // 2,
                          dtype=torch.int8 if bits == 8 else torch.uint8)
    if scales is None:
        scales = torch.empty(-(-n // block_size), dtype=torch.float32)
    _C.cpu_quantize(x, out, scales, bits, block_size, _ENV_ISA, _threads())
    return out, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, *, bits: int = 8, block_size: int = 256,
               numel: Optional[int] = None, out: Optional[torch.Tensor] = None,
               dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """:func:`zkernels.reference.dequantize` natively."""
    _need_ext()
    if numel is None:
        numel = out.numel() if out is not None else q.numel() * (1 if bits == 8 else 2)
    if out is None:
        out = torch.empty(numel, dtype=dtype or torch.float32)
    _C.cpu_dequantize(q, scales, out, bits, block_size, False, 1.0, False, _ENV_ISA,
                      _threads())
    return out


def dequantize_sum(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, bits: int = 8,
                   block_size: int = 256, scale: float = 1.0,
                   accumulate: bool = False) -> torch.Tensor:
    """:func:`zkernels.reference.dequantize_sum` natively: every chunk of a block summed in
    L1, in chunk order, then scaled and rounded into ``out`` in the same pass."""
    _need_ext()
    _C.cpu_dequantize(q, scales, out, bits, block_size, True, float(scale), bool(accumulate),
                      _ENV_ISA, _threads())
    return out


def sum_squares(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """:func:`zkernels.reference.sum_squares` natively: one pass over all tensors, fp64
    accumulation in a fixed order, rounded once to the fp32 result."""
    _need_ext()
    out = torch.zeros((), dtype=torch.float32)
    _C.cpu_sum_squares(tensors, out, _ENV_ISA, _threads())
    return out


# An extension built before the quantization ops (a stale in-place build) lacks their binding:
# then they are not native here, and the dispatcher runs the reference instead of failing.
if _C is not None and not hasattr(_C, "cpu_quantize"):
    del quantize, dequantize, dequantize_sum
if _C is not None and not hasattr(_C, "cpu_adamw_step_lowbit"):
    del adamw_step_lowbit
