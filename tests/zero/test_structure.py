"""The pieces stages are built from: the stage registry (every consumer agrees on it), flat
parameter units (names, views, tied parameters), shard states (ranges map back to parameter
names) and the ops chosen once at construction."""
import pytest
import torch

import zkernels as zk
from tests.zero._harness import make_batches, make_model
from zkernels.layout import FlatLayout
from zkernels.zero.planning import policy
from zkernels.zero.planning.estimate import estimate_memory
from zkernels.zero.optimizer import resolve_stage
from zkernels.zero.parameters.units import ReplicatedParams, build_flat_unit, param_names
from zkernels.zero.state.engine import UpdateEngine
from zkernels.zero.state.places import DevicePlace


# -- the registry ---------------------------------------------------------------------------

def test_every_consumer_reads_the_one_registry():
    assert {s for s, _ in policy.RUNGS} <= set(policy.STAGES)
    assert {o for _, o in policy.RUNGS} <= set(policy.OFFLOADS)
    for stage, pol in policy.STAGES.items():
        assert pol.stage == stage
        estimate_memory(1000, 2, stage)  # the estimator knows every registered stage
        if stage == 0:   # data parallel: the estimator's baseline, not an optimizer stage
            with pytest.raises(ValueError, match="stage must be one of .*got 0"):
                resolve_stage(stage)
        else:
            assert resolve_stage(stage) == stage
    assert resolve_stage("auto") is None
    with pytest.raises(ValueError, match="stage must be one of"):
        resolve_stage(4)


@pytest.mark.parametrize("stage,groups,param_dtype", [(1, 1, torch.bfloat16), (2, 1, None),
                                                      (2, 2, None)])
def test_reduce_buffer_rule_is_shared(monkeypatch, stage, groups, param_dtype):
    """The reducers and the estimator call the same rule: change it and both follow."""
    calls = []
    real = policy.num_reduce_buffers

    def rule(pol, num_buckets, num_groups):
        calls.append((pol.stage, num_buckets, num_groups))
        return min(real(pol, num_buckets, num_groups) + 1, num_buckets)

    monkeypatch.setattr(policy, "num_reduce_buffers", rule)
    model = make_model()
    kw = dict(param_groups=[{"params": [p for n, p in model.named_parameters()
                                        if n.endswith("weight")]},
                            {"params": [p for n, p in model.named_parameters()
                                        if not n.endswith("weight")],
                             "weight_decay": 0.0}]) if groups == 2 else {}
    opt = zk.ZeroOptimizer(model, stage=stage, param_dtype=param_dtype, bucket_bytes=2 ** 16,
                           **kw)
    got = len(opt.reducer.held_buffers())
    assert calls[-1] == (stage, len(opt.units), groups)
    assert got == rule(policy.STAGES[stage], len(opt.units), groups)
    est = estimate_memory(model, 1, stage, param_dtype=param_dtype, bucket_bytes=2 ** 16,
                          num_param_groups=groups)
    pol, est_buckets, est_groups = calls[-1]
    assert (pol, est_groups) == (stage, groups)
    psi = sum(p.numel() for p in model.parameters())
    bucket = min(psi, max(2 ** 16 // 4, max(p.numel() for p in model.parameters())))
    assert est.buffers_bytes == rule(policy.STAGES[stage], est_buckets, groups) * 4 * bucket


# -- units and shard states -----------------------------------------------------------------

def test_units_hold_names_views_and_tied_aliases():
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=2, bucket_bytes=3000)
    named = dict(model.named_parameters())
    seen = []
    for u in opt.units:
        assert isinstance(u.gather, ReplicatedParams) and u.gather.is_gathered
        for name, aliases, p, off in zip(u.names, u.aliases, u.params, u.layout.offsets):
            assert named[name] is p
            assert p.data_ptr() == u.full[off:].data_ptr(), "a parameter is a view of the unit"
            seen.append(name)
            for a in aliases:
                assert model.get_parameter(a) is p
        assert u.compute_shard.data_ptr() == u.full[u.shard_slice].data_ptr()
    assert sorted(seen) == sorted(named), "every parameter in exactly one unit"
    # The GPT ties its head to the token embedding: one parameter, two names.
    tied = [(n, a) for u in opt.units for n, a in zip(u.names, u.aliases) if a]
    assert tied == [("wte.weight", ("head.weight",))]


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_master_is_the_compute_shard_in_fp32_only(param_dtype):
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=1, bucket_bytes=3000, param_dtype=param_dtype)
    for u, st in zip(opt.units, opt.shard_update.states):
        assert st.unit is u and st.unit_index == u.index
        same = st.master.data_ptr() == u.compute_shard.data_ptr()
        assert same == (param_dtype is None)
    if param_dtype is not None:
        assert opt.stats()["memory_bytes"]["master"] == sum(
            4 * u.layout.shard_numel for u in opt.units)


@pytest.mark.parametrize("world_size", [1, 3])
def test_shard_ranges_map_back_to_parameter_names(world_size):
    """Over all ranks, every element of every parameter is in exactly one rank's master
    shard, where the unit's ``param_slices_in_shard`` says, with its original fp32 value."""
    ref = dict((n, p.detach().clone()) for n, p in make_model().named_parameters())
    covered = {n: torch.zeros(p.numel(), dtype=torch.int64) for n, p in ref.items()}
    ops = zk.ops.for_device("cpu")
    for rank in range(world_size):
        model = make_model()
        params = list(model.parameters())
        layout = FlatLayout.build([p.numel() for p in params], world_size, align=8)
        unit, initial = build_flat_unit(0, 0, params, param_names(model), layout, rank,
                                        torch.bfloat16, ops)
        st = UpdateEngine(DevicePlace(ops)).init_state(unit, initial)
        assert st.unit is unit and st.numel == layout.shard_numel
        for name, start_in_param, start_in_shard, n in unit.param_slices_in_shard():
            torch.testing.assert_close(st.master[start_in_shard:start_in_shard + n],
                                       ref[name].view(-1)[start_in_param:start_in_param + n],
                                       rtol=0, atol=0)
            covered[name][start_in_param:start_in_param + n] += 1
    assert all(bool((c == 1).all()) for c in covered.values())


# -- ops chosen once ------------------------------------------------------------------------

def test_ops_backend_is_chosen_once(monkeypatch):
    monkeypatch.setenv("ZKERNELS_BACKEND", "reference")
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=2, bucket_bytes=3000)
    assert set(opt.ops.backends.values()) == {"reference"}
    # A value the public ops would reject: the optimizer's hooks, update and clip never
    # read it again.
    monkeypatch.setenv("ZKERNELS_BACKEND", "not-a-backend")
    with pytest.raises(ValueError, match="ZKERNELS_BACKEND"):
        zk.ops.cast(torch.ones(2), torch.bfloat16)
    idx, tgt = make_batches(1, 2)[0]
    model(idx, tgt).backward()
    opt.step()
    assert set(opt.ops.backends.values()) == {"reference"}


def test_explicit_ops_backend_and_bad_value(monkeypatch):
    monkeypatch.setenv("ZKERNELS_BACKEND", "not-a-backend")   # the argument wins
    opt = zk.ZeroOptimizer(make_model(), stage=1, ops_backend="reference")
    assert set(opt.ops.backends.values()) == {"reference"}
    with pytest.raises(ValueError, match="ops_backend must be None or one of"):
        zk.ZeroOptimizer(make_model(), stage=1, ops_backend="cuda")
    with pytest.raises(ValueError, match="tensors are on"):
        zk.ops.for_device("cuda", "reference").cast(torch.ones(2), torch.bfloat16)


def test_ops_backend_gives_the_same_numbers():
    """Reference vs the default choice: the same losses (the fused kernels are bit-exact
    against the reference in data movement; AdamW within the ops' tolerance)."""
    out = []
    for backend in ("reference", None):
        model = make_model()
        opt = zk.ZeroOptimizer(model, stage=2, bucket_bytes=3000, ops_backend=backend)
        losses = []
        for idx, tgt in make_batches(3, 2):
            loss = model(idx, tgt)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out.append(losses)
    torch.testing.assert_close(out[0], out[1], rtol=1e-5, atol=1e-6)
