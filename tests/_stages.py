"""The ZeRO stages a test runs at: 1, 2 and 3, stage 3 skipped only while the optimizer
refuses it (it is being built; a test written against it today runs the day it lands)."""
from __future__ import annotations

import functools
from typing import List

import pytest
import torch

ALL_STAGES = (1, 2, 3)


@functools.lru_cache(maxsize=None)
def stage_implemented(stage: int) -> bool:
    """Whether ``ZeroOptimizer`` accepts ``stage``: asked by constructing one over a tiny
    module in this process (one rank, no process group). Only a refusal that names the stage
    counts as "not implemented"; any other error is a bug and is raised."""
    import zkernels as zk
    try:
        zk.ZeroOptimizer(torch.nn.Linear(4, 4), stage=stage)
    except (ValueError, NotImplementedError) as exc:
        if "stage" in str(exc):
            return False
        raise
    return True


def stage_params(stages=ALL_STAGES) -> List:
    """``pytest.param`` per stage, stage 3 marked skip while it is not implemented."""
    out = []
    for s in stages:
        marks = () if stage_implemented(s) else (
            pytest.mark.skip(reason=f"stage {s} not implemented yet"),)
        out.append(pytest.param(s, marks=marks, id=f"stage{s}"))
    return out


def implemented_stages(stages=ALL_STAGES) -> List[int]:
    """The stages of ``stages`` the optimizer accepts (for checks that run inside one spawn)."""
    return [s for s in stages if stage_implemented(s)]
