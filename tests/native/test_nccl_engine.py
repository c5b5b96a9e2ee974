"""The NCCL engine binding (zkernels._C_nccl) and its Comm backend.

Without a GPU: the module's error paths (clear exceptions, no crash). With a GPU (run by
benchmarks/gpu_native.sh): world-size-1 collectives of known buffers on the engine's stream,
ordered after a producer stream, bad input, and a bounded failure when a peer never joins.
"""
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist

from zkernels.comm import nccl

GPU = torch.cuda.is_available()


@pytest.fixture
def C_nccl():
    if not nccl.AVAILABLE:
        if GPU and os.environ.get("ZKERNELS_CUDA") == "1":
            pytest.fail(f"ZKERNELS_CUDA=1 on a GPU machine but zkernels._C_nccl does not "
                        f"import: {nccl.IMPORT_ERROR}")
        pytest.skip(f"zkernels._C_nccl not built here ({nccl.IMPORT_ERROR})")
    return nccl._C_nccl


def test_comm_needs_process_group_or_extension():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(RuntimeError, match="_C_nccl|torch.distributed initialized"):
        nccl.NcclComm()


def test_unique_id_and_bad_engine_args(C_nccl):
    uid = C_nccl.unique_id()
    assert isinstance(uid, bytes) and len(uid) == 128
    with pytest.raises(ValueError, match="unique_id must be 128 bytes"):
        C_nccl.Engine(b"short", 0, 1, 0, 5.0)
    with pytest.raises(ValueError, match="rank must be in"):
        C_nccl.Engine(uid, 3, 2, 0, 5.0)


@pytest.mark.skipif(GPU, reason="checks the error path of a machine without a GPU")
def test_engine_without_gpu_raises_named_cuda_error(C_nccl):
    with pytest.raises(RuntimeError, match="CUDA error in cuda"):
        C_nccl.Engine(C_nccl.unique_id(), 0, 1, 0, 5.0)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def comm(C_nccl):
    if not GPU:
        pytest.skip("needs a CUDA device")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    try:
        yield nccl.NcclComm(device=torch.device("cuda", 0), timeout_s=60.0)
    finally:
        dist.destroy_process_group()


def test_world1_collectives_ordered_after_producer_stream(comm):
    n = (1 << 20) + 3
    expected = (torch.arange(n, dtype=torch.float32) % 1000 - 500).cuda()
    producer = torch.cuda.Stream()
    inp = torch.empty(n, device="cuda")
    out = torch.empty(n, device="cuda")
    gathered = torch.empty(n, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(50_000_000)  # the collective must wait for this producer's write
        inp.copy_(expected)
        h = comm.reduce_scatter(out, inp, average=True)
    h.wait()  # current (default) stream now ordered after the reduce-scatter
    comm.all_gather(gathered, out).wait()
    assert torch.equal(gathered, expected)
    flag = torch.tensor([3.0], device="cuda")
    comm.all_reduce(flag, op="max").wait()
    assert flag.item() == 3.0
    for dtype in (torch.bfloat16, torch.float16):
        x = expected.to(dtype)
        y = torch.empty_like(x)
        comm.reduce_scatter(y, x).wait()
        assert torch.equal(y, x)


def test_world1_timing_and_blocking_variant(comm):
    n = 64 * 2**20 // 4
    x = torch.ones(n, device="cuda")
    y = torch.empty(n, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        comm.all_gather(y, x).synchronize()
    print(f"all_gather 64 MiB world 1: {(time.perf_counter() - t0) / 10 * 1e3:.3f} ms")
    assert torch.equal(y, x)


def test_bad_input(comm):
    x = torch.zeros(8, device="cuda")
    with pytest.raises(ValueError, match="output must be a CUDA tensor, got device cpu"):
        comm.reduce_scatter(torch.zeros(8), x)
    with pytest.raises(TypeError, match="input has dtype bfloat16 but output has float32|"
                                        "output has dtype float32 but input has bfloat16"):
        comm.all_gather(torch.zeros(8, device="cuda"), x.bfloat16())
    with pytest.raises(ValueError, match="must have 8 elements"):
        comm.all_gather(torch.zeros(9, device="cuda"), x)
    with pytest.raises(ValueError, match="must be contiguous"):
        comm.reduce_scatter(torch.zeros(16, device="cuda")[::2], x)
    with pytest.raises(ValueError, match="op must be one of"):
        comm.all_reduce(x, op="min")


def test_lonely_rank_times_out_instead_of_hanging(C_nccl):
    if not GPU:
        pytest.skip("needs a CUDA device")
    t0 = time.perf_counter()
    with pytest.raises(C_nccl.NcclTimeoutError, match="did not complete within"):
        C_nccl.Engine(C_nccl.unique_id(), 0, 2, 0, 3.0)
    assert time.perf_counter() - t0 < 30
