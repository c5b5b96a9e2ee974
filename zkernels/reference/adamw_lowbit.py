"""Reference AdamW over low-bit moments (bf16, or blockwise 8-bit codes with fp32 scales), the
moment quantization maps, and a whole-parameter optimizer for parity oracles.

[Note: low-bit moment formats]
Two formats, chosen by the dtypes of ``exp_avg`` / ``exp_avg_sq``:

- **bf16**: both moments are bf16 tensors. Each step widens them to fp32 (exact), runs the fp32
  AdamW arithmetic, and stores them back rounded to nearest even (``Tensor.to``; [Note: exact
  rounding in kernels]). RNE, not stochastic rounding: it is reproducible, bit-exact across
  backends, and needs no random stream to checkpoint or to keep identical across shardings.
  The cost is the known bias of RNE on tiny increments: once ``(1-beta2)*g^2`` is below half a
  bf16 ulp of ``v`` (``v`` has 8 significant bits, so below ~2**-9 relative) the update is
  rounded away and ``v`` only decays (torchtitan's bf16 states make the same trade).
- **int8**: blockwise codes with one fp32 scale per block of ``block_size`` elements (default
  256). Blocks start at element 0 of the buffer passed in, and a tail block may be short; a
  caller whose shard boundaries are multiples of ``block_size`` from the parameter's element 0
  therefore never splits a block, and its shards quantize exactly as the whole parameter does.

  Each block's scale is its absmax (found as [Note: blockwise quantization semantics] finds
  it: by the bits, NaN above inf), and each element is coded by ``y = |x| / absmax`` in
  [0, 1] (one IEEE division) in an 8-bit float code: ``mant_bits`` mantissa bits, normal for
  ``y >= 2**CODE_EMIN`` (``CODE_EMIN = -14``), linear ("subnormal") below it with the lowest
  octave's step, round half to even, ``0`` only for ``y < 2**(CODE_EMIN - mant_bits - 1)``.
  Code ``c`` for ``y >= 2**-14`` is ``(bits(y) - bits(2**-14))`` rounded half to even to a
  multiple of ``2**(23 - mant_bits)``, shifted down, plus ``2**mant_bits`` (the integer order of
  fp32 bits is the order of values, and a carry out of the mantissa steps the exponent);
  below, ``rint(y * 2**(mant_bits + 14))``. Decoding builds the fp32 bits back (or multiplies
  by a power of two), exactly, then multiplies by the scale: ``x_hat = decode(c) * absmax``.
  Only integer operations, one IEEE division, products by powers of two, ``rint`` and (for
  ``v``) the IEEE square root (:func:`zkernels.reference.adamw.sqrt_rn` here, [Note: correctly
  rounded sqrt]) are involved, so the Triton kernel, the C++ paths and this reference produce
  the same bits (no ``pow``/``log``, which are not correctly rounded).
  ``y = 1`` (the block's absmax element) codes as ``15 * 2**mant_bits`` and decodes exactly.

  * ``exp_avg`` (signed): int8 ``+-c`` with ``mant_bits = 3`` (``|c| <= 120``): 8 levels per
    octave over 15 octaves, then linear steps of ``2**-17 * absmax``. Error: at most
    ``2**-4 = 6.25%`` of ``|m|`` (normal), ``2**-18 * absmax`` (below); 0 only under
    ``2**-18 * absmax|m|``.
  * ``exp_avg_sq`` (non-negative): ``r = sqrt(v)`` is coded, uint8 ``c`` with
    ``mant_bits = 4`` (``c <= 240``), the scale is ``absmax(r)``; ``v_hat = r_hat * r_hat``.
    Error in the domain AdamW uses, the denominator ``sqrt(v)``: at most ``2**-5 = 3.1%`` of
    ``r`` (normal), ``2**-19 * absmax(r)`` below; ``v`` rounds to 0 only under
    ``2**-38 = 3.6e-12`` of its block's largest ``v``.

  Why not the linear codes that came first (``q = rint(127 * m / absmax)``, and
  ``rint(255 * sqrt(v) / absmax)``): a linear code of ``sqrt(v)`` rounds ``v`` to 0 below
  ``max(v) / 260100`` of its block. Such elements (rarely-seen embedding rows beside frequent
  ones) then step with ``denom = eps`` while their ``m`` code is not 0: on the demo's GPT
  (seed 1, 300 steps) about 7,300 element-steps had a zero-coded ``v`` beside a nonzero
  ``m`` and normalized updates ``|m_hat| / (sqrt(v_hat) + eps)`` reached 12,000 (fp32 Adam
  keeps them near 1), and two of four seeds ended 6-8% worse than fp32 state
  (benchmarks/README.md). A linear ``m`` code also errs by up to 100% on elements far below
  their block's absmax, which is what their update is divided by. The float codes keep both
  moments to a few % relative over 15 octaves, as bitsandbytes' and torchao's dynamic maps
  (a 256-entry table searched per element, signed for ``m``, unsigned for ``v``, reaching
  ~1e-7 of the block max) do; where we differ: a closed-form code (no table, bit-exact across
  backends), of ``sqrt(v)`` rather than ``v`` (half the dynamic range to cover, and the error
  is in the denominator's units), uniform relative precision (the dynamic map is finer near
  the block max, ~0.4-4%, and coarser far below it).
  * Non-finite values follow [Note: blockwise quantization semantics]: a block holding NaN
    gets scale NaN and codes 0 (it dequantizes to NaN), so a step that was not skipped on a
    non-finite gradient poisons only the blocks it touched, visibly.

One step (``adamw_step_lowbit``): dequantize (or widen) both moments and the master to fp32,
run exactly :func:`zkernels.reference.adamw_step` on them (the param update uses the fp32
moments of this step, as bitsandbytes does, not their requantized values), then requantize (or
round) the moments and store the master (fp32, or bf16 rounded to nearest even). ``found_inf``
nonzero changes nothing, codes and scales included.
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Tuple, Union

import torch

from .adamw import _value, adamw_step, sqrt_rn
from .quant import _INF_BITS, _NAN_BITS, _blocks

Scalar = Union[float, int, torch.Tensor]
EXP_AVG_MANT_BITS = 3     # exp_avg: sign + 7-bit code, |codes| <= 120
EXP_AVG_SQ_MANT_BITS = 4  # sqrt(exp_avg_sq): 8-bit code, codes <= 240
CODE_EMIN = -14           # the codes' smallest normal exponent
_CODE_BASE_BITS = (127 + CODE_EMIN) << 23
INT8_CODE = "float8"           # a checkpoint's state_format "code" for these codes
LINEAR_INT8_CODE = "linear"    # the linear codes before them (a state_format with no "code")
INT8_CODES = (INT8_CODE, LINEAR_INT8_CODE)
DEFAULT_BLOCK_SIZE = 256


def lowbit_format(exp_avg: torch.Tensor) -> str:
    """"bf16" or "int8": the moment format a state's ``exp_avg`` dtype says."""
    return "bf16" if exp_avg.dtype == torch.bfloat16 else "int8"


def _block_amax(flat: torch.Tensor, block_size: int
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(blocks, scale, ok, divisor)`` of the fp32 1-D ``flat``: its zero-padded
    (num_blocks, block_size) view, each block's absmax as [Note: blockwise quantization
    semantics] finds it (``scale``: the absmax, NaN for a block holding NaN, +inf for one
    holding inf, 0 for an all-zero one), ``ok`` where it is finite and nonzero, and ``divisor``
    (the absmax where ok, else 1)."""
    blocks = _blocks(flat, block_size)
    top = (blocks.view(torch.int32) & 0x7FFFFFFF).amax(dim=1)
    amax = top.view(torch.float32)
    ok = (top > 0) & (top < _INF_BITS)
    scale = torch.where(top > _INF_BITS, torch.full_like(top, _NAN_BITS).view(torch.float32),
                        amax)
    return blocks, scale, ok, torch.where(ok, amax, torch.ones_like(amax))


def encode_ratio(y: torch.Tensor, mant_bits: int) -> torch.Tensor:
    """int32 codes of fp32 ``y`` in [0, 1] in the 8-bit float code of [Note: low-bit moment
    formats]: ``mant_bits`` mantissa bits, normal from ``2**CODE_EMIN``, linear (subnormal)
    below it, rounded to nearest even."""
    shift = 23 - mant_bits
    d = y.view(torch.int32) - _CODE_BASE_BITS
    normal = ((d + ((1 << (shift - 1)) - 1) + ((d >> shift) & 1)) >> shift) + (1 << mant_bits)
    sub = torch.round(y * 2.0 ** (mant_bits - CODE_EMIN)).to(torch.int32)
    return torch.where(d >= 0, normal, sub)


def decode_ratio(c: torch.Tensor, mant_bits: int) -> torch.Tensor:
    """fp32 values of the codes ``c`` (>= 0) of :func:`encode_ratio`, exactly."""
    c = c.to(torch.int32)
    normal = (((c - (1 << mant_bits)) << (23 - mant_bits)) + _CODE_BASE_BITS).view(torch.float32)
    sub = c.to(torch.float32) * 2.0 ** (CODE_EMIN - mant_bits)
    return torch.where(c >= (1 << mant_bits), normal, sub)


def check_int8_code(code: str, where: str = "state_format") -> str:
    """``code`` if it names int8 codes this version decodes, else a ValueError naming it."""
    if code not in INT8_CODES:
        raise ValueError(f"{where}: int8 moment code {code!r} is not one this zkernels "
                         f"decodes ({', '.join(INT8_CODES)}); it was written by another "
                         f"version")
    return code


def moments_from_codes(qm: torch.Tensor, qv: torch.Tensor, sm: torch.Tensor, sv: torch.Tensor,
                       code: str = INT8_CODE) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(exp_avg, exp_avg_sq)`` of int8-format codes ``qm`` (int8), ``qv`` (uint8) with
    per-element scales ``sm``, ``sv`` (fp32, the codes' shape), in the code ``code`` names:
    ``INT8_CODE`` (these), or ``LINEAR_INT8_CODE`` (the linear codes of earlier versions, kept
    to read their checkpoints: ``m = q * scale``, ``sqrt(v) = q * scale``)."""
    check_int8_code(code)
    if code == LINEAR_INT8_CODE:
        r = qv.to(torch.float32) * sv
        return qm.to(torch.float32) * sm, r * r
    qm = qm.to(torch.int32)
    x = decode_ratio(qm.abs(), EXP_AVG_MANT_BITS) * sm
    r = decode_ratio(qv, EXP_AVG_SQ_MANT_BITS) * sv
    return torch.where(qm < 0, -x, x), r * r


def quantize_exp_avg(m: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(codes int8, scales fp32)`` of the first moment ``m`` (1-D fp32): the sign and the
    code of ``|m| / absmax`` with ``EXP_AVG_MANT_BITS``; the scale is the block's absmax."""
    flat = m.reshape(-1).float()
    blocks, scale, ok, div = _block_amax(flat, block_size)
    mag = encode_ratio(blocks.abs() / div[:, None], EXP_AVG_MANT_BITS)
    codes = torch.where(ok[:, None], torch.where(blocks < 0, -mag, mag), 0)
    return codes.reshape(-1)[:flat.numel()].to(torch.int8), scale


def dequantize_exp_avg(q: torch.Tensor, scales: torch.Tensor,
                       block_size: int = DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    """fp32 ``+-decode(|q|) * scale`` per element (one product)."""
    s = scales.reshape(-1).repeat_interleave(block_size)[:q.numel()]
    q = q.reshape(-1).to(torch.int32)
    x = decode_ratio(q.abs(), EXP_AVG_MANT_BITS) * s
    return torch.where(q < 0, -x, x)


def quantize_exp_avg_sq(v: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(codes uint8, scales fp32)`` of the second moment ``v`` (1-D fp32, >= 0): the code of
    ``sqrt(v) / absmax(sqrt(v))`` with ``EXP_AVG_SQ_MANT_BITS``; the scale is that absmax."""
    flat = sqrt_rn(v.reshape(-1).float())
    blocks, scale, ok, div = _block_amax(flat, block_size)
    codes = torch.where(ok[:, None], encode_ratio(blocks / div[:, None], EXP_AVG_SQ_MANT_BITS),
                        0)
    return codes.reshape(-1)[:flat.numel()].to(torch.uint8), scale


def dequantize_exp_avg_sq(q: torch.Tensor, scales: torch.Tensor,
                          block_size: int = DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    """fp32 ``r * r`` with ``r = decode(q) * scale`` per element."""
    s = scales.reshape(-1).repeat_interleave(block_size)[:q.numel()]
    r = decode_ratio(q.reshape(-1), EXP_AVG_SQ_MANT_BITS) * s
    return r * r


def adamw_step_lowbit(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                      exp_avg_sq: torch.Tensor, exp_avg_scales: Optional[torch.Tensor] = None,
                      exp_avg_sq_scales: Optional[torch.Tensor] = None, *, lr: float,
                      beta1: float, beta2: float, eps: float, weight_decay: float = 0.0,
                      step: Scalar, decoupled: bool = True,
                      grad_scale: Optional[Scalar] = None,
                      found_inf: Optional[torch.Tensor] = None,
                      out: Optional[torch.Tensor] = None,
                      block_size: int = DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    """One AdamW update over low-bit moments, in place (see [Note: low-bit moment formats]).

    Args:
        param: 1-D contiguous master shard, fp32 or bf16 (bf16: stored rounded to nearest
            even after the fp32 update).
        grad: 1-D, same length, fp32/bf16/fp16, divided by ``grad_scale`` when given.
        exp_avg, exp_avg_sq: both bf16 (the bf16 format), or int8 / uint8 codes (the int8
            format), same length as ``param``; updated in place.
        exp_avg_scales, exp_avg_sq_scales: the int8 format's fp32 block scales,
            ``ceil(numel / block_size)`` each, updated in place; None for bf16.
        lr, beta1, beta2, eps, weight_decay, step, decoupled, grad_scale, found_inf, out: as
            :func:`zkernels.reference.adamw_step`.
        block_size: elements per quantization block (int8 format), a power of two in
            [2, 8192]; blocks start at element 0 of these buffers.

    Returns:
        ``param``.
    """
    if found_inf is not None and _value(found_inf) != 0.0:
        return param
    fmt = lowbit_format(exp_avg)
    p = param.float() if param.dtype != torch.float32 else param
    if fmt == "bf16":
        m, v = exp_avg.float(), exp_avg_sq.float()
    else:
        m = dequantize_exp_avg(exp_avg, exp_avg_scales, block_size)
        v = dequantize_exp_avg_sq(exp_avg_sq, exp_avg_sq_scales, block_size)
    adamw_step(p, grad, m, v, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
               weight_decay=weight_decay, step=step, decoupled=decoupled,
               grad_scale=grad_scale, out=out)
    if fmt == "bf16":
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
    else:
        qm, sm = quantize_exp_avg(m, block_size)
        qv, sv = quantize_exp_avg_sq(v, block_size)
        exp_avg.copy_(qm)
        exp_avg_scales.copy_(sm)
        exp_avg_sq.copy_(qv)
        exp_avg_sq_scales.copy_(sv)
    if p is not param:
        param.copy_(p)
    return param


def new_lowbit_state(numel: int, state_dtype: Union[str, torch.dtype], *,
                     block_size: int = DEFAULT_BLOCK_SIZE, device=None) -> dict:
    """Zero moments of ``numel`` elements in ``state_dtype`` (torch.bfloat16 or "int8"): a dict
    of ``exp_avg``, ``exp_avg_sq`` and, for int8, ``exp_avg_scales``, ``exp_avg_sq_scales``."""
    if state_dtype == torch.bfloat16:
        return {"exp_avg": torch.zeros(numel, dtype=torch.bfloat16, device=device),
                "exp_avg_sq": torch.zeros(numel, dtype=torch.bfloat16, device=device)}
    if state_dtype != "int8":
        raise ValueError(f"state_dtype must be torch.bfloat16 or 'int8', got {state_dtype!r}")
    nb = -(-numel // block_size)
    return {"exp_avg": torch.zeros(numel, dtype=torch.int8, device=device),
            "exp_avg_sq": torch.zeros(numel, dtype=torch.uint8, device=device),
            "exp_avg_scales": torch.zeros(nb, dtype=torch.float32, device=device),
            "exp_avg_sq_scales": torch.zeros(nb, dtype=torch.float32, device=device)}


def dequantized_moments(state: dict, block_size: int = DEFAULT_BLOCK_SIZE
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(exp_avg, exp_avg_sq)`` of a state built by :func:`new_lowbit_state`."""
    if lowbit_format(state["exp_avg"]) == "bf16":
        return state["exp_avg"].float(), state["exp_avg_sq"].float()
    return (dequantize_exp_avg(state["exp_avg"], state["exp_avg_scales"], block_size),
            dequantize_exp_avg_sq(state["exp_avg_sq"], state["exp_avg_sq_scales"], block_size))


class LowbitAdamW:
    """Single-process AdamW with low-bit moments over whole parameters: the parity oracle for a
    sharded run. Each parameter's state is one flat buffer whose quantization blocks start at
    the parameter's element 0, so a sharded optimizer whose shards start at multiples of
    ``block_size`` within each parameter must reproduce it exactly (shards quantize as the
    whole does, see [Note: low-bit moment formats]).

    Args:
        params: tensors (fp32, or bf16 for a bf16 master) with ``.grad`` set before ``step``.
        state_dtype: torch.bfloat16 or "int8".
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        block_size: the int8 format's block size.
    """

    def __init__(self, params: Iterable[torch.Tensor], state_dtype, *, lr: float = 1e-3,
                 betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.params: List[torch.Tensor] = list(params)
        self.hyper = dict(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                          weight_decay=weight_decay)
        self.block_size = block_size
        self.state = [new_lowbit_state(p.numel(), state_dtype, block_size=block_size,
                                       device=p.device) for p in self.params]
        self.steps = 0

    @torch.no_grad()
    def step(self, *, grad_scale: Optional[Scalar] = None,
             found_inf: Optional[torch.Tensor] = None) -> None:
        """One step of every parameter with a gradient (skipped whole when ``found_inf``)."""
        if found_inf is not None and _value(found_inf) != 0.0:
            return
        self.steps += 1
        for p, st in zip(self.params, self.state):
            if p.grad is None:
                continue
            flat = p.data.view(-1)
            adamw_step_lowbit(flat, p.grad.reshape(-1), st["exp_avg"], st["exp_avg_sq"],
                              st.get("exp_avg_scales"), st.get("exp_avg_sq_scales"),
                              step=self.steps, grad_scale=grad_scale,
                              block_size=self.block_size, **self.hyper)
