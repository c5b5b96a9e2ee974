"""The host-built block table of the multi-tensor kernels, and that the Triton backend of
zkernels.ops really runs zkernels.kernels (the op tests would not notice a fallback)."""
import pytest
import torch

pytest.importorskip("triton")
from zkernels import optimizers  # noqa: E402
from zkernels.kernels._tables import build_table  # noqa: E402


def test_block_table_layout():
    numels = [0, 5, 8, 9, 0]
    addrs = [16, 32, 40, 64, 0]  # 40 is not 16-byte aligned
    codes = [7, 7, 7, 7, 7]
    table = build_table([addrs, codes], numels, torch.device("cpu"), block=4,
                        num_address_columns=1)
    t, b = 5, 2 + 2 + 3
    assert (table.num_tensors, table.num_blocks) == (t, b)
    meta = table.meta.tolist()
    assert len(meta) == 4 * t + 2 * b
    assert meta[:t] == addrs and meta[t:2 * t] == codes
    assert meta[2 * t:3 * t] == [1, 1, 0, 1, 1]  # aligned per tensor
    assert meta[3 * t:4 * t] == numels
    assert meta[4 * t:4 * t + b] == [1, 1, 2, 2, 3, 3, 3]  # tensor of each block
    assert meta[4 * t + b:] == [0, 4, 0, 4, 0, 4, 8]  # its first element


def test_block_table_empty():
    table = build_table([[], []], [], torch.device("cpu"), block=4, num_address_columns=2)
    assert table.num_blocks == 0 and table.num_tensors == 0


@pytest.mark.parametrize("op", ["flatten", "unflatten", "bucket_pack", "bucket_unpack", "cast",
                                "unscale_and_check_", "adamw_step", "lion_step", "sgd_step",
                                "sum_squares", "quantize", "dequantize", "dequantize_sum"])
def test_triton_backend_runs_the_kernels(monkeypatch, op):
    import zkernels.kernels
    from zkernels.ops import _backend
    monkeypatch.setenv("ZKERNELS_BACKEND", "triton")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert _backend.choose(op, device) == "triton"
    if op in _backend.KEYWORD_OPTIMIZERS:  # Lion and SGD run the generic optimizer_step
        defn = optimizers.get(_backend.KEYWORD_OPTIMIZERS[op])
        assert _backend.optimizer_implementation(defn, True, device) is \
            zkernels.kernels.optimizer_step
    else:
        assert _backend.implementation(op, device) is getattr(zkernels.kernels, op)
