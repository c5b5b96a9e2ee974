"""Bit-exact checks of the copy ops against the reference, shared by test_cpu_ops
(``zkernels._cpu``: the native backend called directly) and test_checked_copy (``zkernels.ops``:
the public ops through the checked fast path). ``mod`` is either module: both take the same
arguments for flatten / unflatten / bucket_pack / bucket_unpack."""
import torch

from zkernels import reference
from tests.ops._util import assert_bits_equal, awkward_values

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def values(numels, dtype, seed=0):
    return [awkward_values(n, "cpu", seed=seed + i).to(dtype) for i, n in enumerate(numels)]


def nan_bits_defined(src, dst, scale, fp32_route):
    # As tests/ops: NaN bits are defined for fp32 sources that are scaled or cast (PyTorch's
    # own upcasts of bf16/fp16 NaN differ between its vector body and scalar tail); a same-dtype
    # bucket copy at scale 1 keeps NaN bits where the reference's .mul(1.0) quiets sNaN.
    if src != torch.float32:
        return False
    return scale != 1.0 or dst != src or not fp32_route


def flatten_unflatten_bit_exact(mod, ts, layout, dst):
    """``ts`` (one dtype) into a ``dst`` buffer at ``layout``'s offsets and back."""
    src = ts[0].dtype
    flat = torch.full((layout.padded_numel,), 5.0, dtype=dst)
    expected = flat.clone()
    reference.flatten(ts, out=expected, offsets=layout.offsets)
    assert mod.flatten(ts, out=flat, offsets=layout.offsets) is flat
    assert_bits_equal(flat, expected, nan_payload=src in (torch.float32, dst))
    outs = [torch.full((t.numel(),), 3.0, dtype=src) for t in ts]
    exp_outs = [o.clone() for o in outs]
    reference.unflatten(flat, out=exp_outs, offsets=layout.offsets)
    mod.unflatten(flat, out=outs, offsets=layout.offsets)
    for o, e in zip(outs, exp_outs):
        assert_bits_equal(o, e, nan_payload=dst in (torch.float32, src))


def bucket_pack_unpack_bit_exact(mod, ts, layout, dst, scale):
    """``ts`` packed times ``scale`` into a ``dst`` bucket at ``layout``'s offsets, and the
    bucket unpacked times ``scale`` back into tensors of ``ts``' dtype."""
    src = ts[0].dtype
    bucket = torch.full((layout.padded_numel,), 11.0, dtype=dst)
    expected = bucket.clone()
    reference.bucket_pack(ts, expected, layout.offsets, scale=scale)
    assert mod.bucket_pack(ts, bucket, layout.offsets, scale=scale) is bucket
    assert_bits_equal(bucket, expected, nan_bits_defined(src, dst, scale, True))
    outs = [torch.full((t.numel(),), 2.0, dtype=src) for t in ts]
    exp_outs = [o.clone() for o in outs]
    reference.bucket_unpack(bucket, exp_outs, layout.offsets, scale=scale)
    assert mod.bucket_unpack(bucket, outs, layout.offsets, scale=scale) is outs
    for o, e in zip(outs, exp_outs):
        assert_bits_equal(o, e, nan_bits_defined(dst, src, scale, True))
