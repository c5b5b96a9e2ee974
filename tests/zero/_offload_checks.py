"""Offload checks beside the battery's (``_battery.py``: parity with torch.optim.AdamW, state
round trips across placements, ``offload_params`` bit for bit): where the bytes live (device,
host RAM, disk) against the layout and the estimator, the NVMe budget and files, close and
reopen. Run on every rank (module-level so spawned ranks can import them).
"""
from __future__ import annotations

import dataclasses
import os
import time
from functools import partial

import torch

import zkernels as zk
from tests.zero._battery import (CPU_SUB, NVME_BUDGET, SMALL_BUCKET, WD, check_transfer_times,
                                 offload_kw, temp_folder)
from tests.zero._harness import CFG, EPS, GPT, LR, MICRO_BATCH, chunk, make_batches, make_model
from zkernels.zero.planning.offload_config import IO_ALIGN
from zkernels.zero.state.swap import HEADER_BYTES, round_up


def _device_param_bytes(opt, model) -> int:
    """Device bytes held for parameters now: each gather policy's device storage and every
    parameter's (freed parameters are empty), counted once per storage."""
    seen, total = set(), 0
    for t in [t for u in opt.units for t in u.gather.held()] + list(model.parameters()):
        s = t.untyped_storage()
        if t.device.type != "meta" and s.data_ptr() not in seen and s.nbytes():
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def _train(model, opt, rank, ws, steps: int = 2) -> None:
    for batch in make_batches(steps, ws * MICRO_BATCH):
        opt.backward(model(*chunk(batch, rank)))
        opt.step()
        opt.zero_grad()


def params_leave_the_device(rank, ws, *, kind, param_dtype):
    """Stage 3 ``offload_params``: between uses the device holds ~0 parameter bytes (measured
    from the storages: exactly 0 here, every parameter is trainable), while inside a unit's
    forward its parameters are there. The shards are in host RAM instead (CPU offload:
    stats() moves them from device to host, byte for byte against the same run without
    offload_params), or in files (NVMe: stats() puts them on disk, measured from the files,
    and host RAM grows by the two bounces of [Note: parameters on NVMe] only);
    estimate_memory says the same."""
    with temp_folder() as folder:
        runs = []
        for op in (False, True):
            model = make_model()
            kw = {**offload_kw(kind, folder, True), "offload_params": op}
            opt = zk.ZeroOptimizer(model, stage=3, lr=LR, eps=EPS, param_dtype=param_dtype,
                                   **kw)
            inside = []
            block = model.blocks[0]
            # after the schedule's pre-hook (registered first): the unit is gathered here
            h = block.register_forward_pre_hook(
                lambda m, a, opt=opt, model=model: inside.append(
                    _device_param_bytes(opt, model)))
            _train(model, opt, rank, ws)
            h.remove()
            runs.append((model, opt, _device_param_bytes(opt, model), inside, opt.stats()))
        (_, o0, between0, _, st0), (m1, o1, between1, inside1, st1) = runs
        shard_bytes = sum(u.layout.shard_numel * u.compute_shard.element_size()
                          for u in o1.units)
        assert between0 == shard_bytes, (between0, shard_bytes)
        assert between1 == 0, f"offload_params: {between1} parameter bytes left on the device"
        unit0 = next(u for u in o1.schedule.units if u.module is m1.blocks[0])
        assert min(inside1) >= unit0.nbytes > 0, (inside1, unit0.nbytes)
        w0, w1 = st0["memory_location_bytes"], st1["memory_location_bytes"]
        assert w0["device"] - w1["device"] == shard_bytes, (w0, w1, shard_bytes)
        on = st1["memory_bytes_by_location"]
        if kind == "nvme":
            files = [u.shard.file for u in o1.units]
            file_bytes = sum(f.file_bytes for f in files)
            assert file_bytes == sum(round_up(u.layout.shard_numel *
                                              u.compute_shard.element_size()) + HEADER_BYTES
                                     for u in o1.units)
            assert on["disk"]["params"] == file_bytes, (on["disk"], file_bytes)
            assert w1["disk"] - w0["disk"] == file_bytes, (w0, w1, file_bytes)
            assert on["host"]["params"] == 0, on["host"]
            # two one-block bounces (+ their alignment slack): the files come in chunks
            bounces = 2 * (IO_ALIGN + IO_ALIGN)
            assert max(f.data_bytes for f in files) > 2 * IO_ALIGN
            assert st1["offload"]["param_bounce_bytes"] == bounces, st1["offload"]
            assert w1["host"] - w0["host"] == bounces, (w0, w1, bounces)
            assert st1["memory_bytes"]["params"] == file_bytes
        else:
            staging = sum(t.untyped_storage().nbytes()
                          for t in o0.shard_update.held_host().get("buffers", []))
            master = shard_bytes if param_dtype is None else 0  # fp32: one copy
            assert w1["host"] - w0["host"] == shard_bytes - staging - master, \
                (w0, w1, shard_bytes)
            assert st1["memory_bytes"]["params"] == shard_bytes
        fresh = make_model()   # the optimizer's model has empty (sharded) parameters now
        cfg = offload_kw(kind, folder, True)["offload_config"]
        budgets = dict(nvme_buffer_bytes=cfg.nvme_buffer_bytes,
                       nvme_param_buffer_bytes=cfg.nvme_param_buffer_bytes)
        est = zk.estimate_memory(fresh, ws, 3, param_dtype=param_dtype, offload=kind,
                                 offload_params=True, sub_group_numel=CPU_SUB, **budgets)
        est0 = zk.estimate_memory(fresh, ws, 3, param_dtype=param_dtype, offload=kind,
                                  sub_group_numel=CPU_SUB, **budgets)
        numel = sum(p.numel() for p in fresh.parameters())
        p = (param_dtype or torch.float32).itemsize
        assert est0.held_device_bytes - est.held_device_bytes == p * -(-numel // ws)
        assert abs(est.params_bytes - shard_bytes) <= 0.02 * shard_bytes
        if kind == "nvme":
            loc = est.by_location
            assert loc["disk"]["params"] == est.params_bytes and "params" not in loc["host"]
            assert loc["host"]["bounces"] == bounces, (loc, bounces)
        o0.close()
        o1.close()
        assert not any(os.listdir(folder)), "close() removes the parameter files' folder"


def nvme_params_host_ram_is_bounded(rank, ws, *, param_dtype):
    """Parameters on NVMe: however many units and however large, host RAM holds the slot arena
    (within ``nvme_buffer_bytes``) and two bounces (within ``nvme_param_buffer_bytes``); the
    parameter files hold every shard, here several times the bounces' budget."""
    with temp_folder() as folder:
        torch.manual_seed(0)
        model = GPT(dataclasses.replace(CFG, n_layer=8))   # nine units: eight blocks, a root
        kw = offload_kw("nvme", folder, True)
        opt = zk.ZeroOptimizer(model, stage=3, lr=LR, eps=EPS, param_dtype=param_dtype,
                               units=list(model.blocks), **kw)
        _train(model, opt, rank, ws)
        st = opt.stats()
        files = [u.shard.file for u in opt.units]
        shards = sum(f.numel * f.dtype.itemsize for f in files)
        cfg = kw["offload_config"]
        budget, bounces = cfg.nvme_buffer_bytes, cfg.nvme_param_buffer_bytes
        host = st["memory_bytes_by_location"]["host"]
        assert host["params"] == 0 and host["master"] == 0 and host["optimizer_states"] == 0
        assert host["total"] == host["buffers"] <= budget + bounces, (host, budget, bounces)
        assert st["offload"]["param_bounce_bytes"] <= bounces, st["offload"]
        assert len(files) == 9 and shards >= 4 * bounces, (len(files), shards)
        assert st["memory_bytes_by_location"]["disk"]["params"] == sum(f.file_bytes
                                                                       for f in files)
        off = st["offload"]
        # every gather read its whole file (a 4096-byte padded length) and copied its shard
        gathers = off["param_disk_read_bytes"] // min(f.data_bytes for f in files)
        assert off["param_host_to_device_bytes"] <= off["param_disk_read_bytes"] <= \
            off["param_host_to_device_bytes"] + gathers * 4096, off
        assert off["param_disk_write_bytes"] >= shards, off
        opt.close()


def nvme_budget_and_disk(rank, ws, *, nvme_master):
    """Host RAM held by the NVMe strategy stays within its budget while the files hold the
    whole state: 8 (moments) or 12 (with master) bytes per element of this rank's shards,
    measured from fstat (plus one header block per file and padding to 4096 bytes)."""
    with temp_folder() as folder:
        model = make_model()
        opt = zk.ZeroOptimizer(model, stage=2, lr=LR, eps=EPS, bucket_bytes=2 ** 14,
                               param_dtype=torch.bfloat16,
                               **offload_kw("nvme", folder, nvme_master=nvme_master))
        _train(model, opt, rank, ws)
        st = opt.stats()
        shards = [u.layout.shard_numel for u in opt.units]
        psi_over_n = sum(shards)
        kinds = 3 if nvme_master else 2
        data = kinds * sum(round_up(n * 4) for n in shards)
        disk = st["memory_location_bytes"]["disk"]
        assert disk == data + kinds * len(shards) * HEADER_BYTES, (disk, data)
        # = 12 or 8 bytes per shard element, up to the 4096-byte padding of each file
        assert 4 * kinds * psi_over_n <= data < 4 * kinds * psi_over_n + kinds * len(shards) * 4096
        files = [os.path.join(opt.shard_update.place.files.folder, f)
                 for f in os.listdir(opt.shard_update.place.files.folder)]
        assert sum(os.path.getsize(f) for f in files) == disk and len(files) == kinds * len(shards)
        host = st["memory_location_bytes"]["host"]
        arena = opt.shard_update.held_host()["buffers"][0]
        assert arena.untyped_storage().nbytes() <= NVME_BUDGET
        expected_host = arena.untyped_storage().nbytes() + (0 if nvme_master else 4 * psi_over_n)
        assert host == expected_host, (host, expected_host)
        # The estimator says the same (shards are padded per unit; the arena is sized to the
        # largest unit shard under the budget, as the engine sizes it).
        est = zk.estimate_memory(model, ws, 2, param_dtype=torch.bfloat16,
                                 bucket_bytes=2 ** 14, offload="nvme",
                                 nvme_buffer_bytes=NVME_BUDGET, nvme_master=nvme_master)
        assert abs(est.disk_bytes - data) <= 0.05 * data + kinds * len(shards) * 4096
        # (the arena exactly; a host master up to its per-unit padding)
        assert abs(expected_host - est.host_bytes) <= 0.01 * expected_host, \
            (expected_host, est.host_bytes)
        folder_of_run = opt.shard_update.place.files.folder
        opt.close()
        assert not os.path.exists(folder_of_run), "close() removes the run's folder"


def cpu_memory_by_location(rank, ws):
    """CPU offload: master, moments and the gradient shard in host RAM, measured; the device
    keeps the compute parameters and the reduce buffers only; estimate_memory agrees."""
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=2, lr=LR, eps=EPS, bucket_bytes=2 ** 14,
                           param_dtype=torch.bfloat16, **offload_kw("cpu", None))
    for batch in make_batches(2, ws * MICRO_BATCH):
        t0 = time.perf_counter()   # the last step's transfers happen inside its wall time
        opt.backward(model(*chunk(batch, rank)))
        opt.step()
        wall_s = time.perf_counter() - t0
        opt.zero_grad()
    st = opt.stats()
    shard = sum(u.layout.shard_numel for u in opt.units)
    padded = sum(u.layout.padded_numel for u in opt.units)
    staging = 2 * 2 * min(CPU_SUB, max(u.layout.shard_numel for u in opt.units))
    where = st["memory_location_bytes"]
    assert where["host"] == 16 * shard + staging, (where, shard)
    # device: bf16 parameters and the reduce buffers (the staging buffers are host "buffers")
    assert where["device"] == 2 * padded + st["memory_bytes"]["buffers"] - staging
    assert where["disk"] == 0 and where["host"] + where["device"] == st["memory_bytes"]["total"]
    off = st["offload"]
    assert off["device_to_host_bytes"] == 4 * shard and off["host_to_device_bytes"] == 2 * shard
    assert off["device_to_host_s"] > 0 and off["host_to_device_s"] > 0, off
    check_transfer_times(off, wall_s)
    est = zk.estimate_memory(model, ws, 2, param_dtype=torch.bfloat16, bucket_bytes=2 ** 14,
                             offload="cpu", sub_group_numel=CPU_SUB)
    assert abs(est.host_bytes - where["host"]) <= 0.02 * where["host"]
    assert est.host_device_bytes == 6 * -(-sum(p.numel() for p in model.parameters()) // ws)
    opt.close()


def close_and_reopen(rank, ws):
    """NVMe: close(keep_files=True) keeps the run folder; a new optimizer over a differently
    initialized model adopts it (OffloadConfig(resume_dir=...)) and continues exactly."""
    batches = make_batches(6, ws * MICRO_BATCH)
    with temp_folder() as folder:
        def build(seed, **config):
            m = make_model(seed)
            kw = offload_kw("nvme", folder, **config)
            return m, zk.ZeroOptimizer(m, stage=2, lr=LR, eps=EPS, weight_decay=WD,
                                       param_dtype=torch.bfloat16, bucket_bytes=SMALL_BUCKET,
                                       **kw)

        def train(m, o, batch):
            o.backward(m(*chunk(batch, rank)))
            o.step()
            o.zero_grad()

        ref_m, ref_o = build(0)
        m1, o1 = build(0)
        for b in batches[:3]:
            train(ref_m, ref_o, b)
            train(m1, o1, b)
        kept = o1.close(keep_files=True)
        assert os.path.isdir(kept) and os.path.exists(os.path.join(kept, "manifest.json"))
        m2, o2 = build(7, resume_dir=kept)
        assert all(torch.equal(a, b) for a, b in zip(ref_m.parameters(), m2.parameters()))
        for b in batches[3:]:
            train(ref_m, ref_o, b)
            train(m2, o2, b)
            assert all(torch.equal(a, p) for a, p in zip(ref_m.parameters(), m2.parameters()))
        assert all(s.step == 6 for s in o2.shard_update.states)
        o2.close()
        ref_o.close()
        assert not os.path.exists(kept), "the adopted folder belongs to the new run"


CHECKS = {
    "stage3_params_leave_device_fp32_cpu": partial(params_leave_the_device, kind="cpu",
                                                   param_dtype=None),
    "stage3_params_leave_device_bf16_nvme": partial(params_leave_the_device, kind="nvme",
                                                    param_dtype=torch.bfloat16),
    "stage3_params_leave_device_fp32_nvme": partial(params_leave_the_device, kind="nvme",
                                                    param_dtype=None),
    "nvme_params_host_bounded_bf16": partial(nvme_params_host_ram_is_bounded,
                                             param_dtype=torch.bfloat16),
    "nvme_budget_disk_master": partial(nvme_budget_and_disk, nvme_master=True),
    "nvme_budget_disk_moments": partial(nvme_budget_and_disk, nvme_master=False),
    "cpu_memory_by_location": cpu_memory_by_location,
    "close_and_reopen_nvme": close_and_reopen,
}

