"""Rank-side checks of the torch.distributed comm backend (importable by spawned ranks)."""
from __future__ import annotations

import time

import torch

from zkernels.comm import CollectiveError, MeteredComm, VolumeMeter, make_comm
from zkernels.comm.torch_comm import TorchComm


def collectives(rank, ws):
    """Every collective, every dtype, exact on integer-valued inputs (any summation order
    gives the same sum), in place (shard = slice of the full buffer) and not; through the
    public ``dist.*`` functions and, with an own timeout, the group's methods (see [Note:
    timeouts on torch.distributed])."""
    for timeout in (None, 30.0):
        _collectives(rank, ws, timeout)
    return True


def _collectives(rank, ws, timeout):
    comm = make_comm(None, torch.device("cpu"), timeout=timeout)
    assert isinstance(comm, TorchComm) and comm.rank == rank and comm.world_size == ws
    assert comm.timeout_s == timeout
    try:  # the native engine is for CUDA buffers only, built or not
        make_comm(None, torch.device("cpu"), backend="nccl")
    except (RuntimeError, ValueError) as exc:
        assert "CUDA" in str(exc) or "_C_nccl" in str(exc), exc
    else:
        raise AssertionError("backend='nccl' accepted CPU buffers")
    meter = VolumeMeter()
    mc = MeteredComm(comm, meter)
    n = 5
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        full = torch.arange(ws * n, dtype=dt) * (rank + 1)
        total = torch.arange(ws * n, dtype=torch.float32) * sum(range(1, ws + 1))
        out = torch.empty(n, dtype=dt)
        mc.reduce_scatter(out, full.clone()).wait()
        assert torch.equal(out.float(), total[rank * n:(rank + 1) * n]), (dt, out)
        inplace = full.clone()
        mc.reduce_scatter(inplace[rank * n:(rank + 1) * n], inplace).wait()
        assert torch.equal(inplace[rank * n:(rank + 1) * n].float(), total[rank * n:(rank + 1) * n])
        avg_in = torch.full((ws * n,), float(2 * ws), dtype=dt) * (rank + 1)
        mc.reduce_scatter(out, avg_in, average=True).wait()
        assert torch.equal(out.float(), torch.full((n,), float(ws * (ws + 1)))), out
        gathered = torch.zeros(ws * n, dtype=dt)
        gathered[rank * n:(rank + 1) * n] = rank + 1
        mc.all_gather(gathered, gathered[rank * n:(rank + 1) * n]).wait()
        assert torch.equal(gathered, torch.arange(1, ws + 1, dtype=dt).repeat_interleave(n))
    # Non-integer fp32: on gloo the sum is taken in rank order ([Note: reduce-scatter over
    # gloo]), bit for bit; every rank rebuilds every rank's input from its seed.
    inputs = [torch.randn(ws * n, generator=torch.Generator().manual_seed(r)) for r in range(ws)]
    expected = inputs[0][rank * n:(rank + 1) * n].clone()
    for r in range(1, ws):
        expected += inputs[r][rank * n:(rank + 1) * n]
    out32 = torch.empty(n)
    comm.reduce_scatter(out32, inputs[rank].clone()).wait()
    assert torch.equal(out32, expected), (out32, expected)
    t = torch.tensor([float(rank)])
    mc.all_reduce(t, op="max").wait()
    assert t.item() == ws - 1
    mc.all_reduce(t, op="sum").wait()
    assert t.item() == ws * (ws - 1)
    meter.close_step()
    sent = meter.last_step()
    # per dtype: 2 reduce-scatters + 1 average of ws*n elements, 1 all-gather of ws*n.
    rs = sum(3 * ws * n * e * (ws - 1) // ws for e in (4, 2, 2))
    ag = sum(ws * n * e * (ws - 1) // ws for e in (4, 2, 2))
    ar = 2 * (2 * 4 * (ws - 1) // ws)
    assert sent == {"reduce_scatter": rs, "all_gather": ag, "all_reduce": ar,
                    "total": rs + ag + ar}, sent
    try:
        comm.all_gather(torch.empty(ws * n + 1), torch.empty(n))
    except ValueError as exc:
        assert "output" in str(exc)
    else:
        raise AssertionError("a mis-sized all_gather must fail")


def dead_peer(rank, ws, mode, timeout=None, linger_s=7.0):
    """The last rank leaves ("exit") or never joins ("silent": it lingers ``linger_s``, past
    the timeout); the others must raise :class:`CollectiveError` naming the collective, its
    bytes and the tag within the timeout (the comm's own ``timeout`` when given, else the
    process group's) instead of hanging."""
    if rank == ws - 1:
        if mode == "silent":
            time.sleep(linger_s)
        return None
    comm = make_comm(None, torch.device("cpu"), timeout=timeout)
    start = time.time()
    try:
        comm.all_gather(torch.empty(4 * ws), torch.zeros(4), tag="unit blocks.7").wait()
    except CollectiveError as exc:
        assert exc.collective == "all_gather" and exc.nbytes == 16 * ws, (exc.collective,
                                                                          exc.nbytes)
        assert exc.tag == "unit blocks.7" and isinstance(exc.__cause__, RuntimeError)
        return time.time() - start, str(exc)
    raise AssertionError("all_gather with a missing peer returned")


_HELD = []


def holds_group(rank, ws):
    """Keeps a reference to the world group past the end of the rank (what a forgotten DDP
    wrapper or handle does): tests/_dist.py must report it, not pass."""
    import torch.distributed as dist
    _HELD.append(dist.group.WORLD)
    torch.ones(1)  # no collective needed: the group's threads exist from init on
    return True
