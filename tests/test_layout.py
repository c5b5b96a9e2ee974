import pytest

from zkernels.layout import FlatLayout


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("align", [1, 4])
def test_shards_tile_the_buffer_and_cover_every_tensor(world_size, align):
    numels = [0, 1, 7, 278_011, 5]
    lay = FlatLayout.build(numels, world_size, align)
    assert lay.padded_numel % (world_size * align) == 0
    assert lay.padded_numel >= lay.numel > 0
    assert lay.shard_numel * world_size == lay.padded_numel
    assert all(o % align == 0 for o in lay.offsets)
    covered = [0] * len(numels)
    for r in range(world_size):
        for i, t0, s0, n in lay.tensor_slices_in_shard(r):
            assert lay.offsets[i] + t0 == lay.shard_range(r)[0] + s0
            covered[i] += n
    assert covered == numels


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="world_size"):
        FlatLayout.build([3], 0)
    with pytest.raises(ValueError, match=r"numels\[1\]"):
        FlatLayout.build([3, -1], 2)
    with pytest.raises(ValueError, match="rank"):
        FlatLayout.build([3], 2).shard_range(2)
