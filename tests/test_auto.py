"""``stage="auto"``: the budget it measures, the rung it takes for budgets made to fit each, the
clear errors when the rung needed is not in this version or nothing fits, and that every rank
agrees (the budget is the minimum over ranks)."""
import logging

import pytest
import torch

from tests._dist import run_ranks
from zkernels.zero.planning.auto import (host_available_bytes,
                                measure_budget_bytes, resolve_auto_stage)
from zkernels.zero.planning.estimate import estimate_memory
from zkernels.zero.planning.ladder import NoRungFitsError

BUCKET = 4096


def _model():
    torch.manual_seed(0)
    # Eight units: stage 3 (which gathers one unit at a time) needs less than stage 2.
    return torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(7)),
                               torch.nn.Linear(64, 33))


def _need(model, world_size, stage):
    return estimate_memory(model, world_size, stage, bucket_bytes=BUCKET).device_bytes


@pytest.mark.parametrize("stage", [1, 2])
def test_auto_takes_the_lowest_implemented_rung_that_fits(stage, caplog):
    model = _model()
    budget = _need(model, 4, stage)     # exactly enough: no headroom on a user's budget
    with caplog.at_level(logging.INFO, logger="zkernels.zero"):
        got = resolve_auto_stage(model.parameters(), world_size=4, bucket_bytes=BUCKET,
                                 memory_budget_bytes=budget)
    assert got == stage
    assert f"chose stage {stage}" in caplog.text and "lowest rung that fits" in caplog.text


def test_auto_takes_stage3_when_only_it_fits():
    model = _model()
    budget = _need(model, 4, 3)
    assert budget < _need(model, 4, 2)
    assert resolve_auto_stage(model.parameters(), world_size=4, bucket_bytes=BUCKET,
                              memory_budget_bytes=budget) == 3


def test_auto_nothing_fits_and_bad_budget():
    model = _model()
    with pytest.raises(NoRungFitsError, match="no rung of the ladder fits"):
        resolve_auto_stage(model.parameters(), world_size=4, bucket_bytes=BUCKET,
                           memory_budget_bytes=100)
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        resolve_auto_stage(model.parameters(), world_size=4, memory_budget_bytes=-1)


def test_measured_budget_on_cpu():
    model = _model()
    held = sum(p.numel() * 4 for p in model.parameters())
    avail = host_available_bytes()
    assert avail > 0
    budget = measure_budget_bytes(list(model.parameters()), torch.device("cpu"))
    # Free RAM moves a little between the two reads; the held params are added on top.
    assert abs(budget - held - avail) < 0.05 * avail
    # A small model fits this machine at stage 1 with 10% headroom.
    assert resolve_auto_stage(model.parameters(), world_size=1) == 1


def _auto_on_ranks(rank, world_size, budgets):
    model = _model()
    return resolve_auto_stage(model.parameters(), world_size=world_size, bucket_bytes=BUCKET,
                              memory_budget_bytes=budgets[rank])


def test_ranks_agree_on_the_smallest_budget():
    model = _model()
    s1, s2 = _need(model, 2, 1), _need(model, 2, 2)
    # Rank 0 could afford stage 1, rank 1 only stage 2: both must take stage 2.
    assert run_ranks(_auto_on_ranks, 2, [s1, s2]) == [2, 2]


@pytest.fixture
def zkernels_log_level():
    """Restores the "zkernels" logger's level after a test changes it."""
    logger = logging.getLogger("zkernels")
    level = logger.level
    yield logger
    logger.setLevel(level)


def test_auto_choice_is_shown_by_default_and_quiet_on_request(capsys, caplog,
                                                              zkernels_log_level):
    # [Note: auto announcement] Logging not set up for INFO: one line on stderr.
    model = _model()
    budget = _need(model, 4, 2)
    kw = dict(world_size=4, bucket_bytes=BUCKET, memory_budget_bytes=budget)
    assert resolve_auto_stage(model.parameters(), **kw) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zkernels: stage='auto' chose stage 2")
    # Quiet on request: the zkernels logger above INFO; nothing printed, nothing logged.
    zkernels_log_level.setLevel(logging.WARNING)
    with caplog.at_level(logging.INFO):     # root at INFO: only the zkernels level decides
        assert resolve_auto_stage(model.parameters(), **kw) == 2
    assert capsys.readouterr().err == "" and "chose stage" not in caplog.text


def _auto_on_ranks_stderr(rank, world_size, budget):
    import contextlib
    import io
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        resolve_auto_stage(_model().parameters(), world_size=world_size, bucket_bytes=BUCKET,
                           memory_budget_bytes=budget)
    return err.getvalue()


def test_auto_choice_is_shown_once_on_rank_0():
    budget = _need(_model(), 2, 1)
    err0, err1 = run_ranks(_auto_on_ranks_stderr, 2, budget)
    assert "chose stage 1" in err0 and err1 == ""


def test_auto_sizes_the_rungs_with_the_optimizers_state():
    """stage='auto' estimates with the optimizer the groups run (issue 26: it took AdamW's 8
    bytes per element for every optimizer): a budget that fits stage 1 with plain SGD (no
    state) but not with AdamW takes stage 1 for SGD and a higher rung for AdamW; a mix takes
    the largest state (every group must fit)."""
    from zkernels.zero.planning.auto import resolve_rung
    from zkernels.zero.planning.config import ZeroConfig
    from zkernels.zero.planning.optimizer_spec import resolve_optimizer
    model = _model()
    sgd = estimate_memory(model, 4, 1, bucket_bytes=BUCKET, optimizer="sgd",
                          optimizer_kwargs={"lr": 0.1}).device_bytes
    assert sgd < _need(model, 4, 1)
    groups = [{"params": list(model.parameters())}]
    cfg = ZeroConfig.from_kwargs(stage="auto", bucket_bytes=BUCKET)
    specs = {"sgd": resolve_optimizer("sgd", {"lr": 0.1}), "adamw": resolve_optimizer("adamw", {})}

    def stage(*names):
        return resolve_rung(cfg, param_groups=groups, world_size=4, memory_budget_bytes=sgd,
                            process_group=None, model=model,
                            specs=[specs[n] for n in names]).stage
    assert stage("sgd") == 1
    assert stage("adamw") > 1
    assert stage("sgd", "adamw") == stage("adamw")
