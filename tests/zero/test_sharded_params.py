"""Stage 3's gather policy on its own: gather rebuilds the parameters as views of the full
buffer, free gives its storage back, an updated shard is seen by the next gather, on one
rank (LocalComm) and on two gloo ranks, with the shard kept by each storage ([Note: shard
storage]): on the device, in host RAM, in a file."""
import pytest
import torch

from tests._dist import run_ranks
from zkernels.comm import LocalComm, make_comm
from zkernels.layout import FlatLayout
from zkernels.zero.parameters.storage import DeviceShard, DeviceStorage
from zkernels.zero.state.param_nvme import DiskStorage
from zkernels.zero.state.param_offload import HostStorage
from zkernels.zero.state.transfer import Copier
from zkernels.zero.parameters.units import ShardedParams

SHAPES = [(3, 5), (7,), (2, 2, 3)]   # 34 elements: padding on 2 ranks with align 4


def _check(rank, world_size, comm, storage=None):
    torch.manual_seed(0)
    originals = [torch.randn(s) for s in SHAPES]
    params = [torch.nn.Parameter(t.clone()) for t in originals]
    layout = FlatLayout.build([t.numel() for t in originals], world_size, align=4)
    flat = torch.zeros(layout.padded_numel)
    for t, o in zip(originals, layout.offsets):
        flat[o:o + t.numel()] = t.view(-1)
    lo, hi = layout.shard_range(rank)
    values = flat[lo:hi].to(torch.bfloat16)
    sp = ShardedParams(params, layout, storage.keep(values, lo, hi) if storage is not None
                       else DeviceShard(values))
    # Built freed: the parameters are empty (a use fails loudly), no storage; the device
    # holds the shard only where the storage keeps it there.
    assert not sp.is_gathered and sp.full is None
    assert all(p.numel() == 0 and p.untyped_storage().nbytes() == 0 for p in params)
    on_device = storage is None or type(storage) is DeviceStorage
    assert sum(t.untyped_storage().nbytes() for t in sp.held()) == (hi - lo) * 2 * on_device
    for _ in range(2):   # gather, free, gather again
        h = sp.ensure_gathered(comm)
        assert sp.ensure_gathered(comm) is h, "a gather in flight is not repeated"
        h.wait()
        assert sp.is_gathered and sp.full.numel() == layout.padded_numel
        for p, t in zip(params, originals):
            assert p.shape == t.shape and p.dtype == torch.bfloat16
            assert torch.equal(p, t.to(torch.bfloat16))
            assert sp.full.data_ptr() <= p.data_ptr() < sp.full.data_ptr() + sp.full.numel() * 2
        sp.free()
        assert not sp.is_gathered and params[1].numel() == 0
    # An update of this rank's shard reaches every rank at the next gather.
    shard = sp.shard.read_values()   # (a file's values come back by load_values)
    shard.add_(1.0 + rank)
    sp.shard.load_values(shard)
    sp.ensure_gathered(comm).wait()
    sp.publish(comm)            # a gathered copy is stale after an update: freed
    assert not sp.is_gathered
    sp.ensure_gathered(comm).wait()
    got = sp.full.float()
    for r in range(world_size):
        a, b = layout.shard_range(r)
        want = (flat[a:b].to(torch.bfloat16) + (1.0 + r)).float()
        assert torch.equal(got[a:b], want), f"rank {r}'s shard"
    sp.free()
    return True


def test_sharded_params_local():
    assert _check(0, 1, LocalComm())


@pytest.mark.parametrize("where", ["device", "host", "disk"])
def test_each_storage_gathers_the_updated_shard(where, tmp_path):
    copier = Copier(torch.device("cpu"), None)
    storage = {"device": DeviceStorage, "host": lambda: HostStorage(copier),
               "disk": lambda: DiskStorage(copier, tmp_path, 0, 1, 1, None, 1 << 20)}[where]()
    try:
        assert _check(0, 1, LocalComm(), storage)
    finally:
        copier.close()


def _rank(rank, world_size):
    return _check(rank, world_size, make_comm(None, torch.device("cpu"), "torch"))


def test_sharded_params_two_ranks():
    assert run_ranks(_rank, 2) == [True, True]
