"""The ZeRO stages a test runs at: 1, 2 and 3, every one of them implemented. A stage the
optimizer refused would fail the tests built over it (construction raises), never skip them."""
from __future__ import annotations

from typing import List

import pytest

ALL_STAGES = (1, 2, 3)


def stage_params(stages=ALL_STAGES) -> List:
    """``pytest.param`` per stage, with the id ``stage<N>``."""
    return [pytest.param(s, id=f"stage{s}") for s in stages]
