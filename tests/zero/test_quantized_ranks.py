"""The quantized collectives (ZeRO++'s qgZ / qwZ, ``zkernels/comm/quantized.py``) and
``ZeroOptimizer(quantize_grads=, quantize_weights=)`` on 2 gloo ranks, every check in one
spawn, each reported as its own test.

- The comms: the quantized reduce-scatter equals the reference (each chunk quantized with
  ``zkernels.reference.quantize``, the received chunks summed by
  ``zkernels.reference.dequantize_sum``) bit for bit and the exact reduce-scatter within the
  quantization bound; the quantized all-gather equals ``dequantize(quantize(shard))`` of every
  rank bit for bit; inf/NaN propagate; the meter counts payload plus scales.
- Training: parity with unquantized ZeRO (same seeds, same batches) within the tolerance of
  [Note: quantized training parity], at stages 1-3 with bf16, fp16 (its overflow check), a
  bf16 reduction, accumulation, clipping, CPU and NVMe offload and parameters on host; a
  deliberately misrouted exchange fails it. ``ZK_QUANT_PRINT=1`` prints the measured ratios.
- Checkpoints hold exact state: one saved with quantization loads without and back.
- Traffic measured by the meter (issue 17 item 4): stage 3 with both options <= 0.35x bf16
  stage 3, stage 2 with int8 gradients <= 0.6x, and ``estimate_memory`` within 1% of it.

Slow (a 2-rank spawn training a dozen small runs: ~40 s on the shared dev machine).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from functools import partial

import pytest
import torch
import torch.distributed as dist

import zkernels as zk
from tests.zero._harness import (MICRO_BATCH, chunk, make_batches, make_model,
                                 rank_check_tests)
from zkernels import reference as ref
from zkernels.comm import MeteredComm, VolumeMeter, make_comm
from zkernels.comm.quantized import QuantizedGradComm, QuantizedWeightComm

pytestmark = pytest.mark.slow

LR = 3e-3
EPS = 0.1   # see [Note: quantized training parity]

# [Note: quantized training parity]
# The runs compare with unquantized ZeRO on the same seeds and batches: after a few steps, the
# distance between the two runs' exact parameters (stage 3: this rank's shards, which the
# weight quantization never touches; stages 1-2: the full parameters) relative to the
# distance the unquantized run travelled, ``|p_q - p| / |p - p0|``. Adam normalizes each
# element's update, so with torch's eps a gradient element near zero moves by ~lr whatever
# its sign, and quantization noise there would dominate any comparison; EPS = 0.1 puts the
# tiny model's gradients (~1e-3..1e-1) in Adam's near-linear regime, so the measure follows
# the gradients' relative error. Measured on 2 ranks (3-4 steps): int8 gradients 0.010
# (fp32, stage 1) to 0.036 (bf16, accumulation), int4 gradients 0.20-0.28, int8 weights
# 0.078-0.088 (bf16 shards: their rounding is part of it); a misrouted exchange (every chunk
# sent to the other rank) 1.42. The bounds keep 2-3x headroom over those and stay 3x below
# the misrouted exchange; the loss of every step is also within 2% of the unquantized run's.
REL_BOUND = {"int8 grads": 0.1, "int4 grads": 0.5, "int8 weights": 0.2}


def _inputs(world_size: int, numel: int, dtype, seed: int):
    """Every rank's reduce-scatter input, the same on every rank (rank r's from seed + r)."""
    out = []
    for r in range(world_size):
        g = torch.Generator().manual_seed(seed + r)
        x = torch.randn(numel, generator=g) * torch.logspace(-3, 1, numel).flip(0)
        out.append(x.to(dtype))
    return out


def _meter_comm():
    meter = VolumeMeter()
    return MeteredComm(make_comm(None, torch.device("cpu")), meter), meter


def check_reduce_scatter_is_the_reference(rank, ws):
    ops = zk.ops.for_device("cpu")
    cases = [(8, 16, torch.float32, torch.float32, 37, False),
             (4, 16, torch.float32, torch.float32, 37, True),
             (4, 8, torch.float32, torch.float32, 64, False),     # whole blocks: one call
             (8, 256, torch.bfloat16, torch.bfloat16, 300, True),
             (4, 32, torch.bfloat16, torch.float32, 101, False)]
    for bits, block, in_dtype, out_dtype, s, average in cases:
        comm, meter = _meter_comm()
        q = QuantizedGradComm(comm, ops, bits, block)
        xs = _inputs(ws, s * ws, in_dtype, seed=10 * bits + s)
        x = xs[rank].clone()
        if out_dtype == in_dtype:   # in place, as a bucket's own shard slot
            out = x[rank * s:(rank + 1) * s]
        else:
            out = torch.empty(s, dtype=out_dtype)
        q.reduce_scatter(out, x, average=average).wait()
        mine = [xr[rank * s:(rank + 1) * s] for xr in xs]
        coded = [ref.quantize(c, bits=bits, block_size=block) for c in mine]
        codes = torch.stack([c for c, _ in coded])
        scales = torch.stack([sc for _, sc in coded])
        want = torch.empty(s, dtype=out_dtype)
        ref.dequantize_sum(codes, scales, want, bits=bits, block_size=block,
                           scale=1.0 / ws if average else 1.0)
        case = (bits, block, in_dtype, out_dtype, s, average)
        assert torch.equal(out, want), case
        # Within the quantization bound of the exact sum: half a step per rank's block.
        exact = torch.stack([c.float() for c in mine]).sum(0)
        step = scales.repeat_interleave(block, dim=1)[:, :s].sum(0)
        div = ws if average else 1
        bound = (step / 2 + exact.abs() * 2 ** -20) / div
        bound = bound + (want.float().abs() * 2 ** -8 if out_dtype != torch.float32 else 0)
        err = (out.float() - exact / div).abs()
        assert (err <= bound + 1e-7).all(), (case, (err - bound).max())
        assert err.max() > 0, case    # it did quantize
        meter.close_step()
        sent = meter.last_step()
        per = (codes.numel() * codes.element_size() + scales.numel() * 4)
        assert sent["reduce_scatter"] == per * (ws - 1) // ws and sent["total"] == \
            sent["reduce_scatter"], (case, sent)


def check_reduce_scatter_nonfinite(rank, ws):
    ops = zk.ops.for_device("cpu")
    comm, _ = _meter_comm()
    q = QuantizedGradComm(comm, ops, 4, 8)
    s = 24
    x = torch.ones(s * ws)
    if rank == 1:
        x[3] = float("inf")         # rank 0's chunk, block 0
        x[s + 17] = float("nan")    # rank 1's chunk, block 2
    out = torch.empty(s)
    q.reduce_scatter(out, x).wait()
    bad = torch.zeros(s, dtype=torch.bool)
    bad[(0 if rank == 0 else 16):(8 if rank == 0 else 24)] = True
    assert torch.isnan(out[bad]).all() and torch.isfinite(out[~bad]).all(), out


def check_all_gather_is_dequantize_of_quantize(rank, ws):
    ops = zk.ops.for_device("cpu")
    for dtype, s, block in ((torch.float32, 45, 16), (torch.bfloat16, 128, 32),
                            (torch.float16, 70, 64)):
        comm, meter = _meter_comm()
        q = QuantizedWeightComm(comm, ops, block)
        shards = _inputs(ws, s, dtype, seed=s)
        shard = shards[rank].clone()
        out = torch.empty(s * ws, dtype=dtype)
        q.all_gather(out, shard).wait()
        want = torch.cat([ref.dequantize(*ref.quantize(sh, bits=8, block_size=block), bits=8,
                                         block_size=block, numel=s, dtype=dtype)
                          for sh in shards])
        assert torch.equal(out, want), dtype
        assert torch.equal(shard, shards[rank]), "the shard stays exact"
        meter.close_step()
        sent = (s + 4 * -(-s // block)) * ws * (ws - 1) // ws
        assert meter.last_step()["all_gather"] == sent, (dtype, meter.last_step())


def _train(rank, ws, stage, steps=4, micro=1, param_dtype=torch.bfloat16, misroute=False,
           **kw):
    """Losses, initial and final full parameters (fp32) and the last step's stats."""
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=stage, lr=LR, eps=EPS, param_dtype=param_dtype,
                           **({"bucket_bytes": 4000} if stage != 3 else {}), **kw)
    p0 = _params(opt, model)
    if misroute:
        _misroute(opt)
    losses = []
    for batch in make_batches(steps, ws * micro * MICRO_BATCH):
        for m in range(micro):
            ctx = opt.no_sync() if m < micro - 1 else _nullcontext()
            with ctx:
                loss = model(*chunk(batch, rank * micro + m)) / micro
                opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    p = _params(opt, model)
    stats = opt.stats()
    opt.close()
    return losses, p0, p, stats


def _params(opt, model):
    """The exact parameters, fp32: stage 3's shards on this rank (a gathered copy would carry
    the weight quantization), the full parameters at stages 1-2 (gathered exactly)."""
    if opt.stage == 3:
        return torch.cat([u.compute_shard.detach().float().flatten() for u in opt.units])
    return torch.cat([q.detach().float().flatten() for q in model.parameters()])


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _misroute(opt):
    """A broken qgZ for the catch check: each rank sends chunk c to the wrong rank, so a rank
    sums the other rank's shard of the gradient."""
    q = opt.comm
    assert isinstance(q, QuantizedGradComm)
    real = q._quantize_chunks
    q._quantize_chunks = lambda x, chunks, bits: tuple(t.flip(0) for t in real(x, chunks, bits))


def _rel(exact, quant):
    _, p0, p, _ = exact
    return ((quant[2] - p).norm() / (p - p0).norm()).item()


def check_parity(rank, ws, stage, grads=None, weights=None, **kw):
    exact = _train(rank, ws, stage, **kw)
    quant = _train(rank, ws, stage, quantize_grads=grads, quantize_weights=weights, **kw)
    rel = _rel(exact, quant)
    if os.environ.get("ZK_QUANT_PRINT") and rank == 0:
        print("REL", stage, grads, weights, kw, rel, flush=True)
    bound = max(REL_BOUND[f"{fmt} {what}"] for fmt, what in ((grads, "grads"),
                                                             (weights, "weights")) if fmt)
    assert rel <= bound, (rel, bound)
    assert rel > 0, "quantization changed nothing"
    assert all(abs(a - b) <= 0.02 * abs(a) for a, b in zip(exact[0], quant[0])), \
        (exact[0], quant[0])
    return rel


def check_nvme(rank, ws):
    """NVMe offload: the states stream from files; the gradient path is the quantized one."""
    folder = tempfile.mkdtemp(prefix=f"zk-quant-nvme-{rank}-")
    try:
        check_parity(rank, ws, 2, grads="int8", steps=3, offload="nvme", offload_dir=folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def check_misrouted_exchange_fails(rank, ws):
    exact = _train(rank, ws, 2)
    broken = _train(rank, ws, 2, quantize_grads="int8", misroute=True)
    rel = _rel(exact, broken)
    if os.environ.get("ZK_QUANT_PRINT") and rank == 0:
        print("REL misrouted", rel, flush=True)
    assert rel > 4 * REL_BOUND["int8 grads"], rel


def check_fp16_overflow_still_detected(rank, ws):
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=2, lr=LR, param_dtype=torch.float16,
                           quantize_grads="int4", bucket_bytes=4000)
    scale = opt.scaler.scale
    before = [p.detach().clone() for p in model.parameters()]
    batch = make_batches(1, ws * MICRO_BATCH)[0]
    loss = model(*chunk(batch, rank))
    if rank == 1:   # an inf on one rank only: every rank skips
        loss = loss * float("inf")
    opt.backward(loss)
    opt.step()
    assert opt.step_was_skipped and opt.scaler.scale == scale / 2
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.zero_grad()
    opt.close()


def check_checkpoint_is_exact(rank, ws):
    from zkernels import checkpoint
    base = tempfile.mkdtemp(prefix="zk-quant-ckpt-") if rank == 0 else None
    box = [base]
    dist.broadcast_object_list(box)
    path = os.path.join(box[0], "ckpt")
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=3, lr=LR, param_dtype=torch.bfloat16,
                           quantize_grads="int4", quantize_weights="int8")
    for batch in make_batches(2, ws * MICRO_BATCH):
        opt.backward(model(*chunk(batch, rank)))
        opt.step()
        opt.zero_grad()
    checkpoint.save(opt, path)
    saved = opt.state_dict()
    plain_model = make_model(seed=5)
    plain = zk.ZeroOptimizer(plain_model, stage=3, lr=LR, param_dtype=torch.bfloat16)
    checkpoint.load(plain, path)
    _same_state(saved, plain.state_dict())
    path2 = os.path.join(box[0], "ckpt2")
    checkpoint.save(plain, path2)
    again_model = make_model(seed=6)
    again = zk.ZeroOptimizer(again_model, stage=3, lr=LR, param_dtype=torch.bfloat16,
                             quantize_grads="int8", quantize_weights="int8")
    checkpoint.load(again, path2)
    _same_state(saved, again.state_dict())
    for o in (opt, plain, again):
        o.close()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(box[0])


def _same_state(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            _same_state(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def check_traffic_bars(rank, ws):
    model = make_model()
    comm = {}
    for name, stage, kw in (("s3", 3, {}),
                            ("s3_both", 3, dict(quantize_grads="int4", quantize_weights="int8")),
                            ("s2", 2, {}), ("s2_int8", 2, dict(quantize_grads="int8"))):
        comm[name] = _train(rank, ws, stage, steps=1, **kw)[3]["comm_bytes"]
        moved = comm[name]["total"] - comm[name]["all_reduce"]  # without the 4-16 B checks
        est = zk.estimate_memory(model, ws, stage, param_dtype=torch.bfloat16,
                                 bucket_bytes=4000 if stage != 3 else None, **kw)
        assert abs(moved - est.comm_bytes) <= 0.01 * est.comm_bytes, (name, moved, est)
    s3 = comm["s3_both"]["total"] / comm["s3"]["total"]
    s2 = comm["s2_int8"]["total"] / comm["s2"]["total"]
    # int4 codes plus a scale per 256 instead of fp32: (0.5 + 4/256) / 4 of the bytes
    rs = comm["s3_both"]["reduce_scatter"] / comm["s3"]["reduce_scatter"]
    assert abs(rs - (0.5 + 4 / 256) / 4) <= 0.01, rs
    assert s3 <= 0.35 and s2 <= 0.6, (s3, s2, comm)


# Issue 17 item 3 at a smaller size (the 300-step run: docs/benchmark-history.md): the demo's
# GPT and corpus at 2 layers of 64, bf16, stage 3, 40 steps at the demo's lr (1e-3); the mean
# loss of the last 10 steps (the same batches for every run) within 1% of the unquantized
# run's, for each option alone and both together. Measured on 2 ranks: int8 weights -0.33%,
# int8 gradients -0.01%, int4 gradients +0.74%, both +0.75% (int4's coarser gradient slows the
# first steps a little). Later, when a run leaves the loss plateau (~3.3 here) is chaotic and
# the runs part by more for a while (see the README's 300-step figures).
# Not the demo's eval loss (``--eval-batches``, used for the 300-step figures): at step 40
# this model's loss still falls ~0.4% a step, so a snapshot after the last step reads a lead
# or lag of a few steps. Measured on the same runs with 16 eval batches: int8 weights -1.14%
# (ahead), int8 gradients -0.02%, int4 gradients +0.33%, both +0.16%; the fp32 run +0.00%.
QUALITY_STEPS = 40
QUALITY_LR = 1e-3
QUALITY_TAIL = 10


def _quality_run(rank, ws, tokens, **kw):
    from zkernels.demo.data import VOCAB_SIZE, get_batch
    from zkernels.demo.model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB_SIZE, block_size=32, n_layer=2, n_head=2,
                          n_embd=64))
    opt = zk.ZeroOptimizer(model, stage=3, lr=QUALITY_LR, betas=(0.9, 0.95), weight_decay=0.1,
                           param_dtype=torch.bfloat16, **kw)
    losses = []
    for step in range(QUALITY_STEPS):
        x, y = get_batch(tokens, seed=0, step=step, rank=rank, world_size=ws, batch_size=8,
                         block_size=32)
        loss = model(x, y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    opt.close()
    t = torch.tensor(losses[-QUALITY_TAIL:], dtype=torch.float64)
    dist.all_reduce(t)
    return t.mean().item() / ws


def check_demo_quality(rank, ws):
    from zkernels.demo.data import load_corpus
    tokens = load_corpus()
    base = _quality_run(rank, ws, tokens)
    rel = {}
    for kw in (dict(quantize_weights="int8"), dict(quantize_grads="int8"),
               dict(quantize_grads="int4"), dict(quantize_weights="int8", quantize_grads="int4")):
        loss = _quality_run(rank, ws, tokens, **kw)
        rel[str(kw)] = loss / base - 1
    if os.environ.get("ZK_QUANT_PRINT") and rank == 0:
        print("QUALITY", base, rel, flush=True)
    assert all(abs(r) <= 0.01 for r in rel.values()), (base, rel)


CHECKS = {
    "reduce_scatter_is_the_reference": check_reduce_scatter_is_the_reference,
    "reduce_scatter_nonfinite": check_reduce_scatter_nonfinite,
    "all_gather_is_dequantize_of_quantize": check_all_gather_is_dequantize_of_quantize,
    "stage1_int8_fp32": partial(check_parity, stage=1, grads="int8", param_dtype=None),
    "stage2_int4_clip": partial(check_parity, stage=2, grads="int4", max_grad_norm=0.05),
    "stage2_int8_accumulate": partial(check_parity, stage=2, grads="int8", micro=2, steps=3),
    "stage3_weights": partial(check_parity, stage=3, weights="int8"),
    "stage3_both": partial(check_parity, stage=3, grads="int4", weights="int8"),
    "stage3_both_accumulate": partial(check_parity, stage=3, grads="int8", weights="int8",
                                      micro=2, steps=3),
    "stage2_offload_cpu": partial(check_parity, stage=2, grads="int8", offload="cpu", steps=3),
    "stage3_offload_params": partial(check_parity, stage=3, grads="int8", weights="int8",
                                     offload="cpu", offload_params=True, steps=3),
    "stage2_offload_nvme": check_nvme,
    "stage2_bf16_reduce": partial(check_parity, stage=2, grads="int4", steps=3,
                                  reduce_dtype=torch.bfloat16),
    "misrouted_exchange_fails": check_misrouted_exchange_fails,
    "fp16_overflow_still_detected": check_fp16_overflow_still_detected,
    "checkpoint_is_exact": check_checkpoint_is_exact,
    "traffic_bars": check_traffic_bars,
    "demo_quality": check_demo_quality,
}


ranks, test_check = rank_check_tests(CHECKS, 2, timeout=900.0)
