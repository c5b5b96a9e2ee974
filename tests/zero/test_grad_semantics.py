"""A parameter without a gradient this step is skipped as torch.optim skips it (or updated
with a zero gradient, DDP's way, with ``unused_grads="zero"``), at stages 1-3 and CPU offload,
2 gloo ranks (4 in the full suite), against single-process torch.optim.AdamW on the same data
(``_grad_semantics.py``; [Note: unused parameters] in zkernels/zero/gradients/presence.py)."""
import functools

import pytest

import zkernels as zk
from tests.zero import _grad_semantics as gs
from tests.zero._harness import rank_fixture

PATTERNS = ("unused_some_steps", "never_used", "requires_grad_toggled", "used_on_one_rank")
RUNGS = {"s1": dict(stage=1), "s2": dict(stage=2), "s3": dict(stage=3),
         "s2cpu": dict(stage=2, offload="cpu")}

BODIES = {}
for rung, kw in RUNGS.items():
    for pattern in PATTERNS:
        if pattern == "used_on_one_rank" and kw["stage"] == 3:
            continue   # a per-rank path is stage 3's divergent-path error (units=)
        BODIES[f"{rung}-{pattern}"] = functools.partial(gs.parity, pattern=pattern, **kw)
        BODIES[f"{rung}-{pattern}-zero"] = functools.partial(gs.parity, pattern=pattern,
                                                             mode="zero", **kw)
    # catches_: the check fails when ours and the reference's semantics differ.
    BODIES[f"{rung}-catches_zero_vs_skip"] = functools.partial(
        gs.parity, pattern="unused_some_steps", mode="zero", ref_mode="skip", **kw)
    BODIES[f"{rung}-catches_skip_vs_zero"] = functools.partial(
        gs.parity, pattern="never_used", mode="skip", ref_mode="zero", **kw)
    BODIES[f"{rung}-empty_group_lambdalr"] = functools.partial(gs.empty_group, **kw)
    BODIES[f"{rung}-load_mid_run"] = functools.partial(gs.load_mid_run, **kw)
BODIES["s3-load_mid_run_inside_gathered"] = functools.partial(gs.load_mid_run, stage=3,
                                                              inside=True)
for s in (1, 2, 3):
    BODIES[f"s{s}-bf16-load_mid_run"] = functools.partial(gs.load_mid_run_mixed, stage=s)
BODIES["s2cpu-bf16-load_mid_run"] = functools.partial(gs.load_mid_run_mixed, stage=2,
                                                      offload="cpu")
BODIES["s2cpu-bf16-untouched"] = functools.partial(gs.untouched_mixed, stage=2, offload="cpu")
BODIES["s3-bf16-untouched"] = functools.partial(gs.untouched_mixed, stage=3, offload=None)
# A torch.optim class on the pieces skips a piece without a gradient the same way (its
# momentum buffer neither decays nor moves); with "zero" it gets DDP's zero gradient.
for rung in ("s1", "s3", "s2cpu"):
    for mode in ("skip", "zero"):
        BODIES[f"{rung}-sgd-unused_some_steps-{mode}"] = functools.partial(
            gs.parity, pattern="unused_some_steps", mode=mode, sgd=True, **RUNGS[rung])
BODIES["s3-sgd-catches_skip_vs_zero"] = functools.partial(
    gs.parity, pattern="unused_some_steps", mode="skip", ref_mode="zero", sgd=True, stage=3)
for s in (1, 3):
    BODIES[f"s{s}-state-round-trip"] = functools.partial(gs.state_round_trip, stage=s)

ranks = rank_fixture(BODIES)
WS = [2, pytest.param(4, marks=pytest.mark.slow)]


def _rows(kind):
    return [r for r in BODIES if kind(r)]


@pytest.mark.parametrize("world_size", WS)
@pytest.mark.parametrize("row", _rows(lambda r: "-catches_" not in r and r.count("-") and
                                      "untouched" not in r and "round-trip" not in r and
                                      "bf16" not in r))
def test_matches_torch(ranks, world_size, row):
    for res in ranks(row, world_size):
        assert res["worst"] <= 1.0 and res["steps_ok"], res


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("row", _rows(lambda r: "-catches_" in r))
def test_catches_the_other_semantics(ranks, world_size, row):
    for res in ranks(row, world_size):
        assert res["worst"] > 10.0, res


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("row", _rows(lambda r: "untouched" in r))
def test_unused_block_untouched_in_mixed_precision(ranks, world_size, row):
    for res in ranks(row, world_size):
        assert res["unused_same"] and res["used_changed"], res
        assert all((s == 0) == n.startswith("blocks.2.") for n, s in res["steps"].items()), res


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("row", _rows(lambda r: "round-trip" in r))
def test_param_steps_in_state_dict(ranks, world_size, row):
    for res in ranks(row, world_size):
        assert res["same"] and res["same_ckpt"] and res["old"], res
        assert any(len(set(k)) > 1 for k in res["kept"]), "the counts must differ to test"


def test_unused_grads_is_validated():
    import torch
    with pytest.raises(ValueError, match="unused_grads"):
        zk.ZeroOptimizer(torch.nn.Linear(2, 2), unused_grads="none")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unfrozen_after_build_is_refused_by_name(stage):
    """A layer frozen at construction and unfrozen later would never train (it has no slot,
    bucket or state): the next step() names it instead of silently leaving it."""
    import torch
    import torch.nn.functional as F
    torch.manual_seed(0)
    model = gs.Net()
    model.blocks[1].requires_grad_(False)
    opt = zk.ZeroOptimizer(model, stage=stage, lr=gs.LR)
    x, y = gs._batches(1, 0)[0]
    F.mse_loss(model(x, (0, 1, 2)), y).backward()
    opt.step()
    opt.zero_grad()
    model.blocks[1].requires_grad_(True)
    F.mse_loss(model(x, (0, 1, 2)), y).backward()
    with pytest.raises(RuntimeError, match=r"\['blocks\.1\.fc\.weight', 'blocks\.1\.fc\.bias'\] "
                                           r"became trainable after the ZeroOptimizer was built"):
        opt.step()


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("row", _rows(lambda r: "bf16-load_mid_run" in r))
def test_load_mid_run_reaches_the_master(ranks, world_size, row):
    for res in ranks(row, world_size):
        assert res["master_exact"] and res["params_rounded"], res
        # the step after the load starts from the loaded weights: an AdamW step moves an
        # element by lr (|m_hat| / sqrt(v_hat) + wd |w|), a few lr at most this early, plus
        # a bf16 rounding (|w| < 1: 2^-8); restoring the old weights moves them ~0.3
        assert res["moved"] <= 3 * gs.LR + 2 ** -8, res
