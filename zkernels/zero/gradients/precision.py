"""Mixed-precision policy and the dynamic loss scaler.

[Note: where the 1/N and the loss scale are applied]
Gradients are averaged over ranks (DDP semantics) and, in fp16, multiplied by the loss scale
``S`` in backward. Both factors are removed in exactly one place each:
- 1/N: whenever a gradient is *copied* into a reduce buffer (stage 2's hook, stage 1's cast to
  a different reduce dtype), the copy multiplies by 1/N for free (``bucket_pack(scale=1/N)``)
  before the sum, so a sum of N values is never larger than the largest of them and cannot
  overflow fp16 where the inputs did not (bf16 shares fp32's range, so only fp16 could
  overflow; pre-dividing costs log2(N) bits at the bottom of fp16's range, which the loss
  scale is there to keep gradients away from). Where nothing is copied (stage 1 reducing its
  flat grad buffer in its own dtype, fp32 or bf16, neither of which can overflow in a sum of
  N terms), the reduction sums and the 1/N is folded into AdamW's ``grad_scale``: no pass.
  fp16 stage-1 reductions always go through the scaled copy.
- S: folded into AdamW's ``grad_scale`` (and into the clip norm), never a separate pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes of the compute copy and of the gradient reduction.

    Attributes:
        param_dtype: dtype of the model's parameters and gradients during forward/backward;
            float32 means pure fp32 (the parameter is its own master).
        reduce_dtype: dtype in which gradients are summed across ranks.
    """

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32

    @classmethod
    def build(cls, param_dtype: Optional[torch.dtype],
              reduce_dtype: Optional[torch.dtype]) -> "MixedPrecision":
        """From a ``PrecisionConfig``'s dtypes (checked there; None means float32)."""
        return cls(param_dtype or torch.float32, reduce_dtype or torch.float32)

    @property
    def needs_loss_scaling(self) -> bool:
        """fp16 gradients underflow without a loss scale; bf16 and fp32 do not need one."""
        return self.param_dtype == torch.float16


@dataclass(frozen=True)
class LossScaleConfig:
    """Dynamic loss scaling (as ``torch.amp.GradScaler``).

    Attributes:
        init_scale: first scale.
        growth_factor: multiplier after ``growth_interval`` consecutive clean steps.
        backoff_factor: multiplier after a step with an inf/NaN gradient on any rank.
        growth_interval: clean steps between growths.
    """

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        if not self.init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {self.init_scale}")
        if not self.growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {self.growth_factor}")
        if not 0 < self.backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor}")
        if self.growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {self.growth_interval}")


class LossScaler:
    """The current loss scale and its update rule."""

    def __init__(self, config: LossScaleConfig) -> None:
        self.config = config
        self.scale = float(config.init_scale)
        self.clean_steps = 0

    def update(self, found_inf: bool) -> None:
        """Back off after an overflow; grow after ``growth_interval`` clean steps."""
        if found_inf:
            self.scale *= self.config.backoff_factor
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.config.growth_interval:
            self.scale *= self.config.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])
        self.clean_steps = int(sd["clean_steps"])


def make_loss_scaler(precision: MixedPrecision,
                     loss_scale: Optional[LossScaleConfig]) -> Optional[LossScaler]:
    """fp16's dynamic loss scaler (``loss_scale`` or the default config); None in fp32/bf16.

    Raises:
        TypeError: ``loss_scale`` is not a :class:`LossScaleConfig`.
        ValueError: ``loss_scale`` given where nothing is scaled (not fp16).
    """
    if loss_scale is not None and not isinstance(loss_scale, LossScaleConfig):
        raise TypeError(f"loss_scale must be a LossScaleConfig or None, got "
                        f"{type(loss_scale).__name__}")
    if loss_scale is not None and not precision.needs_loss_scaling:
        raise ValueError("loss_scale applies only to param_dtype=torch.float16")
    return LossScaler(loss_scale or LossScaleConfig()) if precision.needs_loss_scaling else None
