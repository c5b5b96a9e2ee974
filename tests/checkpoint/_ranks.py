"""What each rank runs in the checkpoint tests (module-level so spawned ranks import it).

The run: the awkward-size GPT of ``tests/zero/_harness.py`` with two param groups (decay and
no decay) and a registered buffer, a global batch of ``GLOBAL_BATCH`` samples per step split
over the ranks, ``STEPS_BEFORE`` steps, a save, then ``STEPS_AFTER`` more. Resumes rebuild the
model from another seed (so every value must come from the checkpoint) with another bucket
size, at another world size, stage or dtype.
"""
from __future__ import annotations

import functools
import os
import traceback

import torch

import zkernels as zk
from tests.conftest import tol
from tests.zero._harness import EPS, LR, chunk, make_batches, make_model, split_groups, world_mean

GLOBAL_BATCH = 4
STEPS_BEFORE = 5
STEPS_AFTER = 5
BETAS = (0.9, 0.95)
WD = 0.1
SAVE_BUCKET = 3000      # bytes: many buckets, parameters cut by shard boundaries
RESUME_BUCKET = 7000    # another layout on resume
DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def plain(obj):
    """Tensors as numpy arrays (bf16 widened to fp32, exactly), for the trip back to the
    parent: a tensor sent through a multiprocessing queue shares memory with a process that
    exits before the parent reads it."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        return (t.float() if t.dtype == torch.bfloat16 else t).numpy().copy()
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(plain(v) for v in obj)
    return obj


def tensors(obj):
    """Inverse of :func:`plain` (bf16 stays widened)."""
    import numpy as np
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(tensors(v) for v in obj)
    return obj


def split_offload(offload):
    """``(kind, offload_params)`` of a case's offload: None, "cpu", "nvme", or "cpu+params" /
    "nvme+params" (stage 3 with the parameter shards in host RAM, or in files, too)."""
    if offload is None:
        return None, False
    kind, _, extra = offload.partition("+")
    return kind, extra == "params"


def offload_kwargs(offload):
    """ZeroOptimizer's offload keywords for a case's offload (see :func:`split_offload`), an
    NVMe case in a new temporary folder of this rank."""
    kind, params = split_offload(offload)
    out = {"offload": kind, "offload_params": params}
    if kind == "nvme":
        import tempfile
        out["offload_dir"] = tempfile.mkdtemp(prefix="zk-nvme-")
    return out


def build(seed, *, stage, dtype, bucket_bytes, offload=None, offload_dir=None):
    offload, offload_params = split_offload(offload)
    model = make_model(seed)
    model.register_buffer("seen", torch.zeros(3, dtype=torch.int64))
    # The reference ops (torch's arithmetic) everywhere: bf16 trajectories are compared across
    # world sizes (a run continued from its own masters drifts from any AdamW whose fp32
    # round-off differs: see the bf16 oracle in tests/zero/_battery.py), and a saved run and its
    # resumption must share a backend to be compared bit for bit.
    opt = zk.ZeroOptimizer(model, stage=stage, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                           param_groups=split_groups(model, WD), param_dtype=DTYPES[dtype],
                           bucket_bytes=bucket_bytes, offload=offload, offload_dir=offload_dir,
                           ops_backend="reference", offload_params=offload_params)
    return model, opt


def train_step(model, opt, batch, rank, ws):
    loss = model(*chunk(batch, rank, GLOBAL_BATCH // ws))
    loss.backward()
    opt.step()
    opt.zero_grad()
    model.seen += 1
    return world_mean(loss.item(), ws)


def batches():
    return make_batches(STEPS_BEFORE + STEPS_AFTER, GLOBAL_BATCH)


def snapshot(model, opt):
    """Parameters (as trained) and this rank's master shards, on the CPU."""
    with opt.gathered():  # stage 3: the full parameters (a no-op at stages 1-2)
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params,
            "masters": [z.read_state()[1][0].detach().clone() for z in opt.zero_units]}


@functools.lru_cache(maxsize=1)
def reference():
    """Single-process torch.optim.AdamW on the whole batch: (loss, params) after every step
    (computed once per process; do not modify)."""
    ref = make_model(0)
    ropt = torch.optim.AdamW(split_groups(ref, WD), lr=LR, betas=BETAS, eps=EPS,
                             weight_decay=WD)
    out = []
    for batch in batches():
        loss = ref(*batch)
        loss.backward()
        ropt.step()
        ropt.zero_grad()
        out.append((loss.item(), {n: p.detach().clone() for n, p in ref.named_parameters()}))
    return out


def save_run(rank, ws, folder, stage=2):
    """Train, save to ``folder/<dtype>`` after STEPS_BEFORE, continue uninterrupted; return the
    uninterrupted run's losses and snapshots after each later step, per dtype."""
    out = {}
    for dtype in DTYPES:
        model, opt = build(0, stage=stage, dtype=dtype, bucket_bytes=SAVE_BUCKET)
        losses, snaps, at_save = [], [], None
        for i, batch in enumerate(batches()):
            if i == STEPS_BEFORE:
                zk.checkpoint.save(opt, os.path.join(folder, dtype),
                                   model_extra={"step": i, "note": ("saved", ws)})
                at_save = {k: v.detach().clone() for k, v in model.state_dict().items()}
            loss = train_step(model, opt, batch, rank, ws)
            if i >= STEPS_BEFORE:
                losses.append(loss)
                snaps.append(snapshot(model, opt)["params"])
        out[dtype] = {"losses": losses, "params": snaps, "saved_ws": ws, "saved_stage": stage,
                      "at_save": at_save}
    return plain(out)


def resume_case(rank, ws, folder, *, stage, offload, dtype, offload_dir=None):
    """Load ``folder/<dtype>`` into a freshly built optimizer, train STEPS_AFTER steps.

    fp32: every step's loss and parameters equal single-process AdamW's uninterrupted run to
    fp32 round-off (tol(float32), as tests/zero's parity checks). Returns the losses and
    parameters after each step for the caller's comparison with the saved run."""
    # The saved run's own configuration keeps its bucket layout (its continuation is compared
    # bit for bit); every other case also changes the layout.
    same = (ws, stage) == (2, 2)
    model, opt = build(123, stage=stage, dtype=dtype,
                       bucket_bytes=SAVE_BUCKET if same else RESUME_BUCKET,
                       offload=offload, offload_dir=offload_dir)
    extra = zk.checkpoint.load(opt, os.path.join(folder, dtype))
    assert extra == {"step": STEPS_BEFORE, "note": ("saved", 2)}, extra
    assert torch.equal(model.seen, torch.full((3,), STEPS_BEFORE)), model.seen
    assert opt.stats()["step"] == STEPS_BEFORE
    assert opt.meter.current_step()["total"] == 0, "checkpoint traffic is not a step's"
    ref = reference() if dtype == "fp32" else None
    losses, snaps = [], []
    for i, batch in enumerate(batches()[STEPS_BEFORE:]):
        losses.append(train_step(model, opt, batch, rank, ws))
        snaps.append(snapshot(model, opt)["params"])
        if ref is not None:
            rloss, rparams = ref[STEPS_BEFORE + i]
            torch.testing.assert_close(losses[-1], rloss, **tol(torch.float32))
            for n, p in snaps[-1].items():
                torch.testing.assert_close(p, rparams[n], **tol(torch.float32),
                                           msg=lambda m, n=n: f"step {i}, {n}: {m}")
    return plain({"losses": losses, "params": snaps})


def resume_battery(rank, ws, folder, cases, offload_root):
    """Run every ``(stage, offload, dtype)`` case; name -> result or the traceback."""
    out = {}
    for stage, offload, dtype in cases:
        name = (stage, offload, dtype)
        try:
            odir = os.path.join(offload_root, f"{ws}-{stage}-{offload}-{dtype}-r{rank}") \
                if split_offload(offload)[0] == "nvme" else None
            out[name] = ("ok", resume_case(rank, ws, folder, stage=stage, offload=offload,
                                           dtype=dtype, offload_dir=odir))
        except Exception:  # noqa: BLE001 - reported per case
            out[name] = ("error", traceback.format_exc())
    return out


def _die_mid_write(victim_rank):
    """Make rank ``victim_rank`` SIGKILL itself after writing the first tensor of its shard:
    a file half-written, never closed, no index, as a real crash leaves it."""
    import signal

    from zkernels.checkpoint import _tensorfile
    real = _tensorfile.TensorFileWriter.write
    calls = {"n": 0}

    def write(self, key, tensor):
        real(self, key, tensor)
        calls["n"] += 1
        if calls["n"] == 2:
            self._file.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    if torch.distributed.get_rank() == victim_rank:
        _tensorfile.TensorFileWriter.write = write


def killed_save(rank, ws, folder):
    """Save once (the good checkpoint), train a step, save again with rank 1 killed while
    writing. The survivor must fail with SaveAbortedError (not hang), and return the
    consolidated good checkpoint and what the folder holds."""
    model, opt = build(0, stage=2, dtype="fp32", bucket_bytes=SAVE_BUCKET)
    data = batches()
    train_step(model, opt, data[0], rank, ws)
    zk.checkpoint.save(opt, folder, model_extra={"step": 1})
    good = zk.checkpoint.consolidate(folder)
    train_step(model, opt, data[1], rank, ws)
    _die_mid_write(victim_rank=1)
    try:
        zk.checkpoint.save(opt, folder, model_extra={"step": 2})
    except zk.checkpoint.SaveAbortedError as exc:
        return plain({"error": str(exc), "good": good})
    return plain({"error": None, "good": good})
