"""Stage 3's unit states ([Note: unit states] in zkernels/zero/parameters/unit_state.py) on one
process: the sequence each unit goes through in forward and backward, with a block run twice,
with reentrant and non-reentrant activation checkpointing, without autograd, inside
``gathered()``; a flat's storage through gather, reshard to its secondary chunk and free; an
illegal move raises naming the unit and both states."""
import pytest
import torch

import zkernels as zk
from tests.zero._harness import LR, make_batches, make_model, variant
from zkernels.comm import LocalComm
from zkernels.layout import FlatLayout
from zkernels.zero.parameters.secondary import SecondaryShard
from zkernels.zero.parameters.unit_state import ShardedState as S, TrainingState as T
from zkernels.zero.parameters.storage import DeviceShard
from zkernels.zero.parameters.units import ShardedParams

TRAIN = [T.FORWARD, T.POST_FORWARD, T.PRE_BACKWARD, T.POST_BACKWARD]


def _recorded(opt):
    """Per unit name, the states it moved to (repeats collapsed), and the forwards seen as
    (unit, state, in backward)."""
    history, forwards = {}, []
    for u in opt.schedule.units:
        seen = history.setdefault(u.name, [])

        def spy(new, u=u, seen=seen, move=u.move):
            move(new)
            if not seen or seen[-1] is not u.state:
                seen.append(u.state)
        u.move = spy
        u.module.register_forward_pre_hook(
            lambda m, a, u=u: forwards.append((u.name, u.state, opt.schedule.in_backward)))
    return history, forwards


@pytest.mark.parametrize("ckpt, order", [(None, (0, 1)), (None, (0, 1, 0)),
                                         ("non_reentrant", (0, 1)), ("reentrant", (0, 1))])
def test_states_through_a_step(ckpt, order):
    torch.set_num_threads(1)
    model = variant(make_model(), order, ckpt)
    opt = zk.ZeroOptimizer(model, stage=3, lr=LR)
    history, forwards = _recorded(opt)
    (x, y), = make_batches(1, 2)
    model(x, y).backward()
    assert all(u.state is T.IDLE and u.depth == 0 for u in opt.schedule.units)
    assert opt.schedule.live_bytes() == 0
    assert history["<root>"] == TRAIN
    # reentrant: the forward ran without autograd (FORWARD -> IDLE) and the recompute's nested
    # backward brings the gradients (IDLE -> POST_BACKWARD)
    want = [T.FORWARD, T.IDLE, T.POST_BACKWARD] if ckpt == "reentrant" else TRAIN
    assert history["blocks.0"] == history["blocks.1"] == want, history
    recomputes = [(n, s) for n, s, in_bwd in forwards if in_bwd]
    if ckpt is None:
        assert not recomputes
        assert [s for n, s, _ in forwards if n == "blocks.0"] == \
            [T.FORWARD, T.POST_FORWARD][:len(order) - 1], "a repeated call stays POST_FORWARD"
    else:  # every block recomputed inside backward, its step state left as it was
        assert sorted(n for n, _ in recomputes) == ["blocks.0", "blocks.1"]
        assert {s for _, s in recomputes} <= ({T.IDLE} if ckpt == "reentrant"
                                              else {T.POST_FORWARD, T.PRE_BACKWARD})
    opt.step()


def test_states_without_autograd_kept_and_gathered():
    torch.set_num_threads(1)
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=3, lr=LR, reshard_after_forward=False)
    history, _ = _recorded(opt)
    (x, y), = make_batches(1, 2)
    with torch.no_grad():
        model(x, y)
    assert all(h == [T.FORWARD, T.IDLE] for h in history.values()), history
    assert opt.schedule.live_bytes() == 0
    loss = model(x, y)  # reshard_after_forward=False: kept from forward to backward
    blocks = opt.schedule.units[:-1]
    assert all(u.state is T.POST_FORWARD and u.kept and u.allocated for u in blocks)
    assert opt.schedule.live_bytes(transient_only=True) == 0
    loss.backward()
    assert not any(u.kept or u.allocated for u in opt.schedule.units)
    with opt.gathered():
        assert all(u.state is T.IDLE and u.pins == 1 for u in opt.schedule.units)
        assert all(f.gather.state is S.UNSHARDED for u in opt.schedule.units for f in u.flats)
    assert all(f.gather.state is S.SHARDED for u in opt.schedule.units for f in u.flats)


def test_an_illegal_move_names_the_unit_and_both_states():
    torch.set_num_threads(1)
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=3, lr=LR)
    u = opt.schedule.units[0]
    with pytest.raises(RuntimeError, match="unit 'blocks.0' cannot move from IDLE to "
                                           "POST_FORWARD"):
        u.move(T.POST_FORWARD)
    u.state = T.PRE_BACKWARD  # as if a backward had left it behind
    (x, y), = make_batches(1, 2)
    with pytest.raises(RuntimeError, match="unit 'blocks.0' cannot move from PRE_BACKWARD to "
                                           "FORWARD"):
        model(x, y)


def test_flat_storage_through_gather_reshard_and_free():
    params = [torch.nn.Parameter(torch.randn(3, 5)), torch.nn.Parameter(torch.randn(7))]
    layout = FlatLayout.build([15, 7], 1, align=4)
    flat = torch.zeros(layout.padded_numel)
    for p, o in zip(params, layout.offsets):
        flat[o:o + p.numel()] = p.detach().reshape(-1)
    values = [p.detach().clone() for p in params]
    comm = LocalComm()
    sp = ShardedParams(params, layout, DeviceShard(flat.clone()))
    sp.name = "unit 'u' (flat 0)"
    sp.secondary = SecondaryShard(comm, layout.padded_numel, flat.dtype, flat.device)
    assert sp.state is S.SHARDED and sp.full is None
    h = sp.ensure_gathered(comm)
    assert sp.state is S.UNSHARDING and sp.full is not None and not sp.is_gathered
    h.wait()
    assert sp.state is S.UNSHARDED and sp.is_gathered
    sp.reshard()  # keep the secondary chunk, free the full buffer
    assert sp.state is S.SHARDED_POST_FORWARD and len(sp.held()) == 2
    assert params[0].numel() == 0
    sp.ensure_gathered(comm).wait()  # from the chunk
    assert sp.state is S.UNSHARDED and len(sp.held()) == 3
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    sp.free()
    assert sp.state is S.SHARDED and len(sp.held()) == 1  # the chunk went with it
    with pytest.raises(RuntimeError, match="unit 'u' \\(flat 0\\) cannot move from SHARDED to "
                                           "UNSHARDED"):
        sp._move(S.UNSHARDED)
