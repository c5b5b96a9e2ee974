"""Sharded checkpoints of a ``ZeroOptimizer``: atomic, safe to load, any world size and stage.

    zk.checkpoint.save(opt, "ckpt/step1000", model_extra={"sched": sched.state_dict()})
    extra = zk.checkpoint.load(opt, "ckpt/step1000")   # any world size, stage, dtype
    weights = zk.checkpoint.consolidate("ckpt/step1000")  # {state_dict key: fp32 tensor}
    moments = zk.checkpoint.consolidate_moments("ckpt/step1000")  # fp32 AdamW moments
    zk.checkpoint.import_deepspeed(opt, "ds_ckpt")  # a DeepSpeed ZeRO 1-3 checkpoint
    zk.checkpoint.import_dcp(opt, "dcp_dir")        # FSDP2's torch.distributed.checkpoint
    zk.checkpoint.export_dcp(opt, "dcp_dir")        # ... and back (dcp.load + set_state_dict)

    python -m zkernels checkpoint consolidate ckpt/step1000 model.safetensors [--dtype bf16]
    python -m zkernels checkpoint consolidate ckpt/step1000 hf_dir --hf --config cfg.json
    python -m zkernels checkpoint verify ckpt/step1000   # (or python -m zkernels.checkpoint)

A checkpoint is a folder: one file per saving rank holding its pieces of every parameter
(element ranges, fp32 master and AdamW moments), one for frozen parameters and buffers, and a
JSON manifest with sizes and per-block CRC-32s (see ``manifest.py`` and [Note: checkpoint
file format] in ``_tensorfile.py``). Nothing is ever unpickled.
"""
from ._safe_pickle import UnsafeCheckpointError
from .consolidate import consolidate, consolidate_moments, consolidate_to_file, verify
from .errors import (CheckpointError, CorruptCheckpointError, IncompatibleCheckpointError,
                     NotACheckpointError, SaveAbortedError, UnsupportedVersionError)
from .dcp import export_dcp, import_dcp
from .deepspeed_import import import_deepspeed
from .load import load
from .pretrained import (LoadResult, consolidate_to_pretrained, load_pretrained,
                         save_pretrained)
from .save import save

__all__ = ["save", "load", "import_deepspeed", "import_dcp", "export_dcp",
           "UnsafeCheckpointError", "load_pretrained", "save_pretrained", "LoadResult",
           "consolidate_to_pretrained", "consolidate", "consolidate_moments",
           "consolidate_to_file", "verify", "CheckpointError", "CorruptCheckpointError",
           "IncompatibleCheckpointError", "NotACheckpointError", "SaveAbortedError",
           "UnsupportedVersionError"]
