"""Quantized collectives (ZeRO++'s qgZ and qwZ) as :class:`~zkernels.comm.base.Comm` wrappers.

:class:`QuantizedGradComm` turns ``reduce_scatter`` into blockwise int8/int4 quantization per
destination chunk, an all-to-all of the codes and the fp32 scales, and a fused
dequantize-and-sum on arrival; :class:`QuantizedWeightComm` turns ``all_gather`` into an
all-gather of int8 codes and scales dequantized into the output. Every other collective passes
through to the wrapped comm unchanged. Semantics of the blocks: [Note: blockwise quantization
semantics] in ``zkernels/reference/quant.py``.

[Note: quantized reduce-scatter]
``reduce_scatter(output, input)`` over N ranks, ``input`` of N chunks of ``s = output.numel()``
elements: at launch each chunk ``c`` (destined for rank ``c``) is quantized on its own into
``bits``-bit codes with one fp32 scale per ``block_size`` elements (blocks restart at every
chunk, so a chunk is a whole quantized buffer; when ``s`` is a multiple of the block size the
chunks are quantized in one call, which gives the same blocks); then two all-to-alls send chunk
``c``'s codes and scales to rank ``c`` (rank r receives its chunk from every rank, rank order).
``wait()`` finishes both and runs ``ops.dequantize_sum`` over the N received chunks into
``output``: the sum in fp32 in rank order, times ``1/N`` with ``average``, rounded once to
``output``'s dtype. So the result is bit for bit ``sum_r dequantize(quantize(chunk_r of rank
r's input))``, the reference op's answer, and differs from the exact reduce-scatter by at most
``sum_r scale_r / 2`` per element (half a quantization step per rank's block) plus the sum's
rounding to ``output``'s dtype. ``output`` may
alias ``input`` (a bucket's own shard slot): the input is read only at launch. An inf or NaN in
any rank's block makes that block's scale inf/NaN and every element of it NaN after the sum,
so the optimizer's non-finite check still trips. Bytes each rank sends (counted as the
meter's ``reduce_scatter`` kind, see [Note: ring volume] in meter.py): ``(N-1)/N`` of the codes
plus the scales, ``bits/8 + 4/block_size`` bytes per element: against an fp32 reduce, 0.254x
(int8) or 0.129x (int4) at block 256. The codes and scales, sent and received, are transient
(allocated at launch, freed at ``wait()``): about 0.5x (int8) of an fp32 bucket.

[Note: quantized all-gather]
``all_gather(output, input)``: this rank's ``input`` (the compute shard) is quantized to int8
with fp32 block scales, both are all-gathered (the ``all_gather`` kind counts the bytes, codes
plus scales), and ``wait()`` dequantizes every rank's chunk, this rank's included, into its
slot of ``output`` in ``output``'s dtype (one call over all of them when the shard is whole
blocks), so every rank computes with the same parameters. The
shard itself is never changed: the fp32 master and the compute shard stay exact, only the
gathered copy carries the quantization error (at most half a step, ``amax/254`` of its block).
The optimizer uses it for stage 3's gathers, forward and backward (the re-gather before
backward is a gather like any other); stages 1-2's post-update all-gather stays exact.

[Note: where we differ from DeepSpeed ZeRO++]
Checked against the DeepSpeed installed here (0.19.8: ``runtime/zero/partition_parameters.py``,
``runtime/comm/coalesced_collectives.py``):

- Gradients: DeepSpeed's qgZ (``zero_quantized_gradients``) is int4 only, with quantization
  groups sized from the tensor's shape, and sends each 1-D tensor (biases, norms) through an
  exact reduce-scatter. Here ``quantize_grads`` is "int8" or "int4" with one block size for
  every bucket or unit (``quantize_block``), flat buffers quantized whole.
- Hierarchy: DeepSpeed's qgZ is two quantized all-to-all hops (within the node, re-quantize the
  partial sums, across nodes). Here the quantized all-to-all runs within the shard group and,
  with hybrid sharding, the reduced shard is all-reduced across groups exactly in the reduce
  dtype (hybrid.py's hop unchanged): the across-group hop is Ψ/K elements, already K times
  smaller than the gradients.
- Weights: DeepSpeed's qwZ (``zero_quantized_weights``) quantizes through fp16 (its kernel reads
  ``__half``), with adaptive group sizes below 8k elements; here the shard is quantized as it
  is (fp32/bf16/fp16 read exactly as fp32), blocks of ``quantize_block``.
- Secondary shards (hpZ): DeepSpeed quantizes the backward gather from the secondary tensor
  too. Here the secondary chunk keeps the forward's dequantized values and the backward gather
  within the R-rank secondary group is exact, so forward and backward see the same weights.
- Frozen parameters: stage 3 gathers them with their unit, through the same quantized gather
  (DeepSpeed asks separately, ``zero_quantized_nontrainable_weights``).
- The kernels are ours (Triton, C++ SIMD, reference), so this runs on CPU (gloo) too;
  DeepSpeed's quantizer is CUDA only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch

from .base import CollectiveError, Comm, Handle
from ..ops.quant import _CODE_DTYPES, check_block_size, code_numel, num_blocks

GRAD_FORMATS = {"int8": 8, "int4": 4}
WEIGHT_FORMATS = {"int8": 8}


class _Finishing:
    """Handle of inner collectives followed by a local finishing step (dequantize)."""

    def __init__(self, handles: Sequence[Handle], finish: Callable[[], None],
                 fail: Callable[[CollectiveError], CollectiveError]) -> None:
        self._handles: Optional[List[Handle]] = list(handles)
        self._finish, self._fail = finish, fail

    def done(self) -> bool:
        """Whether every inner collective is complete (``wait()`` still dequantizes); hybrid
        sharding asks, see ``hybrid.py``."""
        if self._handles is None:
            return True
        for h in self._handles:
            done = getattr(h, "done", None)
            if done is None or not done():
                return False
        return True

    def wait(self) -> None:
        if self._handles is None:
            return
        handles, self._handles = self._handles, None
        try:
            for h in handles:
                h.wait()
        except CollectiveError as exc:
            raise self._fail(exc) from exc
        self._finish()


def _check_flat(what: str, name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{what}: {name} must be a contiguous 1-D tensor, got shape "
                         f"{tuple(t.shape)}")
    if not t.is_floating_point():
        raise TypeError(f"{what}: {name} must be a floating tensor, got {t.dtype}")


def _bits(fmt, formats: dict, name: str) -> int:
    if not isinstance(fmt, str) or fmt not in formats:
        raise ValueError(f"{name} must be None or one of {tuple(formats)}, got {fmt!r}")
    return formats[fmt]


class _Wrapper:
    """Pass-through of every collective to ``inner``; ``inner`` (the attribute the checkpoint
    code and the secondary groups read) is the exact, unmetered comm beneath."""

    def __init__(self, comm: Comm, ops, block_size: int) -> None:
        self.comm = comm
        self.ops = ops
        self.block_size = check_block_size(block_size, "quantize_block")
        self.rank, self.world_size = comm.rank, comm.world_size

    @property
    def inner(self) -> Comm:
        """The exact comm without meter (checkpoint traffic is exact and not a step's)."""
        return getattr(self.comm, "inner", self.comm)

    def __getattr__(self, name: str):  # group, device, progress, ... of the wrapped comm
        if name in ("comm", "ops"):
            raise AttributeError(name)
        return getattr(self.comm, name)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *,
                       average: bool = False, tag: Optional[str] = None) -> Handle:
        return self.comm.reduce_scatter(output, input, average=average, tag=tag)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *,
                   tag: Optional[str] = None) -> Handle:
        return self.comm.all_gather(output, input, tag=tag)

    def all_reduce(self, tensor: torch.Tensor, *, op: str = "sum",
                   tag: Optional[str] = None) -> Handle:
        return self.comm.all_reduce(tensor, op=op, tag=tag)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *,
                   tag: Optional[str] = None) -> Handle:
        return self.comm.all_to_all(output, input, tag=tag)

    def _quantize_chunks(self, x: torch.Tensor, chunks: int, bits: int):
        """``x`` cut into ``chunks`` equal chunks, each quantized on its own: codes
        (chunks, code_numel) and scales (chunks, num_blocks)."""
        s = x.numel() // chunks
        cn, nb = code_numel(s, bits), num_blocks(s, self.block_size)
        codes = torch.empty(chunks, cn, dtype=_CODE_DTYPES[bits], device=x.device)
        scales = torch.empty(chunks, nb, dtype=torch.float32, device=x.device)
        if s % self.block_size == 0:   # whole blocks per chunk: one call, the same blocks
            self.ops.quantize(x, bits=bits, block_size=self.block_size, out=codes.view(-1),
                              scales=scales.view(-1))
        else:
            for c in range(chunks):
                self.ops.quantize(x[c * s:(c + 1) * s], bits=bits, block_size=self.block_size,
                                  out=codes[c], scales=scales[c])
        return codes, scales


class QuantizedGradComm(_Wrapper):
    """A comm whose ``reduce_scatter`` is ZeRO++'s qgZ (see [Note: quantized reduce-scatter]).

    Args:
        comm: the comm to wrap (it must have ``all_to_all``: torch_comm, local, the meter).
        ops: the :class:`~zkernels.ops.OpSet` whose quantize / dequantize_sum run.
        bits: 8 or 4.
        block_size: elements per scale, a power of two in [2, 8192].
    """

    def __init__(self, comm: Comm, ops, bits: int, block_size: int = 256) -> None:
        if bits not in _CODE_DTYPES:
            raise ValueError(f"bits must be 8 or 4, got {bits!r}")
        base = getattr(comm, "inner", comm)   # the backend beneath a meter
        if not callable(getattr(base, "all_to_all", None)):
            raise ValueError(f"quantized gradients need a comm with all_to_all; "
                             f"{type(base).__name__} has none")
        super().__init__(comm, ops, block_size)
        self.bits = bits

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *,
                       average: bool = False, tag: Optional[str] = None) -> Handle:
        what = "reduce_scatter"
        _check_flat(what, "output", output)
        _check_flat(what, "input", input)
        n = self.world_size
        if input.numel() != output.numel() * n:
            raise ValueError(f"{what}: input must have {n} x output.numel() = "
                             f"{output.numel() * n} elements, got {input.numel()}")
        codes, scales = self._quantize_chunks(input, n, self.bits)
        got_codes, got_scales = torch.empty_like(codes), torch.empty_like(scales)
        handles = [self.comm.all_to_all(got_codes.view(-1), codes.view(-1), tag=tag),
                   self.comm.all_to_all(got_scales.view(-1), scales.view(-1), tag=tag)]
        scale = 1.0 / n if average else 1.0
        keep = [codes, scales]   # alive until the exchange is done

        def finish() -> None:
            keep.clear()
            self.ops.dequantize_sum(got_codes, got_scales, output, bits=self.bits,
                                    block_size=self.block_size, scale=scale)

        def fail(exc: CollectiveError) -> CollectiveError:
            return CollectiveError(
                f"quantized reduce_scatter (int{self.bits} blocks through all_to_all) of "
                f"{input.numel() * input.element_size()} bytes: {exc}",
                collective=what, nbytes=input.numel() * input.element_size(), tag=tag)

        return _Finishing(handles, finish, fail)


class QuantizedWeightComm(_Wrapper):
    """A comm whose ``all_gather`` is ZeRO++'s qwZ (see [Note: quantized all-gather]).

    Args:
        comm: the comm to wrap.
        ops: the :class:`~zkernels.ops.OpSet` whose quantize / dequantize run.
        block_size: elements per scale, a power of two in [2, 8192].
    """

    bits = 8

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *,
                   tag: Optional[str] = None) -> Handle:
        what = "all_gather"
        _check_flat(what, "output", output)
        _check_flat(what, "input", input)
        n, s = self.world_size, input.numel()
        if output.numel() != s * n:
            raise ValueError(f"{what}: output must have {n} x input.numel() = {s * n} "
                             f"elements, got {output.numel()}")
        codes, scales = self._quantize_chunks(input, 1, self.bits)
        all_codes = torch.empty(n, codes.shape[1], dtype=codes.dtype, device=codes.device)
        all_scales = torch.empty(n, scales.shape[1], dtype=scales.dtype, device=scales.device)
        handles = [self.comm.all_gather(all_codes.view(-1), codes.view(-1), tag=tag),
                   self.comm.all_gather(all_scales.view(-1), scales.view(-1), tag=tag)]
        keep = [codes, scales]

        def finish() -> None:
            keep.clear()
            if s % self.block_size == 0:   # whole blocks per rank: one call, the same blocks
                self.ops.dequantize(all_codes.view(-1), all_scales.view(-1), bits=self.bits,
                                    block_size=self.block_size, out=output)
                return
            for r in range(n):
                self.ops.dequantize(all_codes[r], all_scales[r], bits=self.bits,
                                    block_size=self.block_size, out=output[r * s:(r + 1) * s])

        def fail(exc: CollectiveError) -> CollectiveError:
            return CollectiveError(
                f"quantized all_gather (int8 blocks) of {output.numel() * output.element_size()}"
                f" bytes: {exc}", collective=what,
                nbytes=output.numel() * output.element_size(), tag=tag)

        return _Finishing(handles, finish, fail)


def quantize_grads_comm(comm: Comm, ops, bits: int, block_size: int) -> Comm:
    """``comm`` with quantized reduce-scatters; with hybrid sharding
    (:class:`~zkernels.comm.hybrid.HybridComm`) the shard group's are quantized and the
    cross-group all-reduce stays exact (see [Note: where we differ from DeepSpeed ZeRO++])."""
    from .hybrid import HybridComm
    if isinstance(comm, HybridComm):
        return HybridComm(QuantizedGradComm(comm.shard, ops, bits, block_size),
                          comm.replicate, comm.world)
    return QuantizedGradComm(comm, ops, bits, block_size)


def check_quantize_backend(quantize_grads, quantize_weights, comm_backend: str, device) -> None:
    """The quantization options (formats and block checked by ``ZeroConfig``'s
    ``QuantizeConfig``) against the comm engine.

    Raises:
        ValueError: either option with the native NCCL engine (no all-to-all, no int8
            buffers); each message names the option.
    """
    from .select import resolve_backend
    if resolve_backend(comm_backend, device) != "nccl":
        return
    if quantize_grads is not None:
        raise ValueError(f"quantize_grads={quantize_grads!r} needs an all-to-all, which the "
                         f"native NCCL engine (comm_backend='nccl') does not have: use "
                         f"comm_backend='torch' (NCCL through torch.distributed)")
    if quantize_weights is not None:
        raise ValueError(f"quantize_weights={quantize_weights!r} gathers int8 codes, which "
                         f"the native NCCL engine (comm_backend='nccl', fp32/bf16/fp16 "
                         f"only) does not move: use comm_backend='torch'")


@dataclass(frozen=True)
class Quantization:
    """``ZeroOptimizer``'s quantization options, checked (see [Note: quantized reduce-scatter]
    and [Note: quantized all-gather]).

    Attributes:
        grads: None, ``"int8"`` or ``"int4"``; weights: None or ``"int8"``; block: elements
            per fp32 scale.
    """

    grads: Optional[str]
    weights: Optional[str]
    block: int
    grad_bits: Optional[int]
    weight_bits: Optional[int]

    @classmethod
    def build(cls, quantize_grads, quantize_weights, quantize_block, comm_backend: str,
              device) -> "Quantization":
        """From checked formats and block (see :func:`check_quantize_backend`)."""
        check_quantize_backend(quantize_grads, quantize_weights, comm_backend, device)
        return cls(quantize_grads, quantize_weights, quantize_block,
                   GRAD_FORMATS.get(quantize_grads), WEIGHT_FORMATS.get(quantize_weights))

    def grad_comm(self, comm: Comm, ops) -> Comm:
        """The gradient strategies' comm: ``comm`` with quantized reduce-scatters, or
        ``comm`` itself."""
        if self.grad_bits is None:
            return comm
        return quantize_grads_comm(comm, ops, self.grad_bits, self.block)

    def gather_comm(self, comm: Comm, ops) -> Comm:
        """Stage 3's parameter-gather comm: ``comm`` with quantized all-gathers, or
        ``comm`` itself."""
        if self.weight_bits is None:
            return comm
        return QuantizedWeightComm(comm, ops, self.block)
