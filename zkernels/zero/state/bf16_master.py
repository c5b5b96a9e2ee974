"""The fused AdamW over a bf16 master (``master_dtype=torch.bfloat16``).

[Note: bf16 master]
``ZeroOptimizer(master_dtype=torch.bfloat16)`` keeps the fused AdamW's master in bf16: no
fp32 copy of the parameters anywhere. It needs bf16 parameters (``param_dtype=torch.bfloat16``
or a bf16 model; a bf16 master under fp32 or fp16 parameters is refused by name), and then
the master is the bf16 parameter shard itself wherever that shard lives beside the step (on
the device, or in host RAM with CPU ``offload_params``): 0 bytes of master per element, as
pure fp32 training's master is its parameter; where it lives apart it is a bf16 host shard
(CPU offload with the shard on the device) or a bf16 swap file (NVMe offload, read into and
written from the slots at 2 bytes per element: ``nvme_files.NvmeFiles.file_spec``), 2 bytes
per element instead of 4.
``stats()``, ``estimate_memory`` and ``plan`` count it so.

With low-bit moments (``state_dtype``) the fused low-bit AdamW takes the bf16 master itself
(``ops.adamw_step_lowbit``: its Triton, C++ and reference paths read it as fp32 and store it
rounded to nearest even in the same pass). With fp32 moments the fused AdamW
(``ops.adamw_step``, whose Triton and C++ kernels take an fp32 master only) runs unchanged on
an fp32 copy of the piece's bf16 master (exact: bf16 widens to fp32 without loss), and
:func:`on_bf16_master` writes the result back rounded to nearest even (``Tensor.copy_``'s
cast, the same rounding as the compute-dtype output). Either way the update's arithmetic is
the fp32 master's and the master after a step is exactly
``bf16_rne(adamw_fp32(float(master)))``: the single-process oracle (the battery's ``master=``
rows, [Note: a bf16 master against its oracle] in tests/zero/_battery.py) applies that
rounding after torch's AdamW and matches. We route the fp32-moment case through the fp32
kernels instead of writing a bf16-master variant of each: the arithmetic and the rounding are
the same, and the cost is one transient fp32 copy of the piece (a sub-group with offload; on
the device one unit's shard, freed after its update) plus one extra pass over 6 bytes per
element.

Round-to-nearest-even, not stochastic rounding: reproducible, bit-exact across backends and
world sizes, and nothing random to checkpoint. What it costs: an update smaller than half a
bf16 ulp of its parameter (``|Δ| < 2**-9 |p|``) is lost, every step: with lr 1e-3 and
AdamW's update near ``lr`` in size, parameters above ~0.5 in magnitude stop moving unless
their update is larger, and weight decay (``lr * wd * p``, 1e-5 relative at lr 1e-3, wd
0.01) never acts on its own. Stochastic rounding (or Kahan compensation, which needs the 2
bytes back) would keep those updates in expectation. Measured on the demo's GPT (2 ranks,
bf16 compute, lr 1e-3, four seeds): the mean eval loss is 1.4% above the fp32 master's at 300
steps and 1.6% at 600 (``docs/training.md``, "A bf16 master").
"""
from __future__ import annotations

from typing import Callable, Optional

import torch


def on_bf16_master(master: torch.Tensor, out: Optional[torch.Tensor],
                   step: Callable[[torch.Tensor, Optional[torch.Tensor]], None]) -> None:
    """Run ``step(fp32_master, out)`` (a fused AdamW call over the piece) on an fp32 copy of
    the bf16 ``master`` and write the result back rounded to nearest even; ``out`` (the
    compute-dtype output) gets the rounded master, unless it is the master itself."""
    wide = master.float()
    step(wide, None)
    master.copy_(wide)
    if out is not None and out.data_ptr() != master.data_ptr():
        out.copy_(master)
