"""``comm.bucketed.BucketedReduceScatter``: buckets launch strictly in index order whatever
the order members arrive in, a repeated member closes the round, buffers stay bounded."""
import torch

from zkernels.comm import BucketedReduceScatter, LocalComm


class _Recording(LocalComm):
    def __init__(self):
        self.launched = []

    def reduce_scatter(self, output, input, *, average=False):
        self.launched.append(input.numel())
        return super().reduce_scatter(output, input, average=average)


def _make(comm, got):
    numels = [4, 8, 12]   # bucket i is recognised by its size
    return BucketedReduceScatter(comm, numels, [slice(0, n) for n in numels], [2, 1, 2],
                                 torch.float32, torch.device("cpu"), 2,
                                 lambda bi, s: got.append((bi, s.sum().item())))


def test_launch_order_and_rounds():
    comm, got = _Recording(), []
    rs = _make(comm, got)
    rs.buffer(2).fill_(1.0)
    rs.complete(2, 0)
    rs.complete(2, 1)           # bucket 2 complete but 0 and 1 are not: nothing launches
    assert comm.launched == [] and rs.round_started()
    rs.buffer(1).fill_(2.0)
    rs.complete(1, 0)
    assert comm.launched == []
    rs.complete(0, 0)
    assert rs.seen(0, 0) and not rs.seen(0, 1)
    rs.complete(0, 1)           # now 0, 1, 2 launch, in that order; the round ends
    assert comm.launched == [4, 8, 12] and not rs.round_started()
    rs.drain()
    assert got == [(0, 0.0), (1, 16.0), (2, 12.0)]
    assert len(rs.buffers) == 3, "one extra buffer while complete buckets waited"
    # A member arriving twice: the caller flushes; pending buckets launch (zeros included).
    rs.complete(0, 0)
    assert rs.seen(0, 0)
    packed = []
    rs.flush(packed.append)
    assert packed == [0, 1, 2] and comm.launched[3:] == [4, 8, 12]
    rs.discard()
    assert not rs.round_started()
