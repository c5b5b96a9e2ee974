"""``comm.bucketed``: buckets launch strictly in index order whatever the order members arrive
in, a repeated member closes the round, buffers stay bounded."""
import torch

from zkernels.comm import LaunchOrder, LocalComm, ReduceBucket, ReducePool


class _Recording(LocalComm):
    def __init__(self):
        self.launched = []

    def reduce_scatter(self, output, input, *, average=False):
        self.launched.append(input.numel())
        return super().reduce_scatter(output, input, average=average)


class _Packing(ReduceBucket):
    """A bucket whose owner still holds nothing: ``pack_held`` records the flush."""

    def __init__(self, i, pool, numel, members, got, packed):
        super().__init__(pool, numel, slice(0, numel), members)
        self.i, self.got, self.packed = i, got, packed

    def reduced(self, shard):
        self.got.append((self.i, shard.sum().item()))

    def pack_held(self):
        self.packed.append(self.i)


def _make(comm, got, packed):
    numels = [4, 8, 12]   # bucket i is recognised by its size
    pool = ReducePool(comm, max(numels), torch.float32, torch.device("cpu"), 2)
    buckets = [_Packing(i, pool, n, m, got, packed) for i, (n, m) in
               enumerate(zip(numels, [2, 1, 2]))]
    return LaunchOrder(buckets, pool), buckets


def test_launch_order_and_rounds():
    comm, got, packed = _Recording(), [], []
    order, (b0, b1, b2) = _make(comm, got, packed)
    b2.buffer().fill_(1.0)
    b2.add(0)
    b2.add(1)                   # bucket 2 complete but 0 and 1 are not: nothing launches
    assert comm.launched == [] and order.started()
    b1.buffer().fill_(2.0)
    b1.add(0)
    assert comm.launched == []
    b0.add(0)
    assert b0.seen(0) and not b0.seen(1)
    b0.add(1)                   # now 0, 1, 2 launch, in that order; the round ends
    assert comm.launched == [4, 8, 12] and not order.started()
    order.drain()
    assert got == [(0, 0.0), (1, 16.0), (2, 12.0)]
    assert len(order.pool.buffers) == 3, "one extra buffer while complete buckets waited"
    # A member arriving twice: the caller flushes; pending buckets launch (zeros included).
    b0.add(0)
    assert b0.seen(0) and b1.seen(0) is False
    order.flush()
    assert packed == [0, 1, 2] and comm.launched[3:] == [4, 8, 12]
    assert not b0.seen(0), "a flush starts a new round"
    b1.buffer()
    assert order.started()
    order.discard()
    assert not order.started() and b1._buf is None
