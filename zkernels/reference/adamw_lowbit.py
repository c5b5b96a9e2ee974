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

  * ``exp_avg`` (signed): int8 codes in [-127, 127] and an absmax scale, the arithmetic of
    [Note: blockwise quantization semantics] (``quant.py``) with qmax 127. Dequantized
    ``m = float(q) * scale``; error ``|m - m_hat| <= scale / 2 = amax|m| / 254`` per block.
  * ``exp_avg_sq`` (non-negative): the **square root** ``r = sqrt(v)`` is quantized linearly to
    uint8 codes in [0, 255] with an absmax scale (same arithmetic, qmax 255); dequantized
    ``r_hat = float(q) * scale``, ``v_hat = r_hat * r_hat``. Error in the domain AdamW uses,
    the denominator ``sqrt(v)``: ``|r - r_hat| <= amax(r) / 510`` per block. Small values are
    kept: ``v`` rounds to 0 only below ``(amax(r) / 510)**2 = max(v) / 260100`` of its block,
    where a linear absmax code of ``v`` itself (255 levels) zeroes everything below
    ``max(v) / 510``. Where bitsandbytes/torchao differ: they use a dynamic (exponent-coded)
    map for both moments, which reaches ~1e-7 of the block max; the square-root map is
    linear, cheaper (no table lookup or search) and uniform in ``sqrt(v)``. An element whose
    ``sqrt(v)`` is below ``scale / 2`` while its ``m`` code is not 0 gets ``denom = eps``, a
    large step, as with any code that rounds ``v`` to 0: that needs ``|m| < amax(r) / 510``
    while ``|m| >= amax|m| / 254``, i.e. a block whose ``amax|m|`` is below half its
    ``amax sqrt(v)``'s /255 level, which bias-corrected Adam moments rarely reach.
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

from .adamw import _value, adamw_step
from .quant import block_codes

Scalar = Union[float, int, torch.Tensor]
EXP_AVG_QMAX = 127
EXP_AVG_SQ_QMAX = 255
DEFAULT_BLOCK_SIZE = 256


def lowbit_format(exp_avg: torch.Tensor) -> str:
    """"bf16" or "int8": the moment format a state's ``exp_avg`` dtype says."""
    return "bf16" if exp_avg.dtype == torch.bfloat16 else "int8"


def quantize_exp_avg(m: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(codes int8, scales fp32)`` of the first moment ``m`` (1-D fp32), absmax, qmax 127."""
    codes, scales = block_codes(m.reshape(-1).float(), block_size, EXP_AVG_QMAX)
    return codes.to(torch.int8), scales


def dequantize_exp_avg(q: torch.Tensor, scales: torch.Tensor,
                       block_size: int = DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    """fp32 ``float(q) * scale`` per element."""
    s = scales.reshape(-1).repeat_interleave(block_size)[:q.numel()]
    return q.reshape(-1).to(torch.float32) * s


def quantize_exp_avg_sq(v: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(codes uint8, scales fp32)`` of the second moment ``v`` (1-D fp32, >= 0): its square
    root quantized linearly, absmax, qmax 255."""
    codes, scales = block_codes(v.reshape(-1).float().sqrt(), block_size, EXP_AVG_SQ_QMAX)
    return codes.to(torch.uint8), scales


def dequantize_exp_avg_sq(q: torch.Tensor, scales: torch.Tensor,
                          block_size: int = DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    """fp32 ``r * r`` with ``r = float(q) * scale`` per element."""
    s = scales.reshape(-1).repeat_interleave(block_size)[:q.numel()]
    r = q.reshape(-1).to(torch.float32) * s
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
