"""Offload checks each rank runs (module-level so spawned ranks can import them).

Offload changes where the state lives, not the arithmetic: the same stage without offload on
the same data is the reference, step by step. Where the device and the host run the same AdamW
backend (here: both the C++ extension, or both the reference), results must be bit-identical;
elsewhere (a GPU's Triton AdamW against the host's C++ one) they agree to the round-off of two
correct fp32 AdamWs (tol(float32); bf16: the same-recipe tolerance of ``bf16_parity``).
"""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
from functools import partial

import torch

import zkernels as zk
from tests.conftest import tol
from tests.zero._harness import EPS, LR, MICRO_BATCH, chunk, make_batches, make_model, run_checks
from tests.zero._rank_checks import BETAS, SMALL_BUCKET, WD, fp32_parity
from zkernels.zero import OffloadConfig
from zkernels.zero.state.swap import HEADER_BYTES, round_up

# Several sub-groups per unit: the smallest NVMe budget for three one-block slots (master and
# moments on disk, an fp32 gradient and a bf16 output) is 3 x 1024 x (12 + 4 + 2) + 2 x 4096
# bytes; this one gives 1024-element slots.
NVME_BUDGET = 3 * 1024 * 18 + 2 * 4096 + 1000
CPU_SUB = 700   # elements per CPU AdamW sub-group: not a divisor of any shard


def _offload_kw(kind, folder, **config):
    if kind == "cpu":
        return dict(offload="cpu", offload_config=OffloadConfig(sub_group_numel=CPU_SUB,
                                                                **config))
    return dict(offload="nvme", offload_dir=folder,
                offload_config=OffloadConfig(nvme_buffer_bytes=NVME_BUDGET, **config))


@contextlib.contextmanager
def _folder():
    path = tempfile.mkdtemp(prefix="zk-offload-test-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _same_backend(dev_opt, off_opt) -> bool:
    return dev_opt.ops.backends["adamw_step"] == off_opt.shard_update.host_ops.backends[
        "adamw_step"]


def _compare(model, ref, step, exact, dtype):
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if exact:
            assert torch.equal(p, q), f"step {step}, {n}: offload changed the arithmetic"
        else:
            torch.testing.assert_close(p.float(), q.float(), **tol(dtype),
                                       msg=lambda m, n=n: f"step {step}, {n}: {m}")


def against_device(rank, ws, *, kind, param_dtype=None, steps=10, micro=1, clip=None,
                   nvme_master=True, stage=2, offload_params=False):
    """Stage 2 (or 3) with offload == the same stage on the device, loss and every parameter
    each step, and the optimizer state (master, moments) at the end. With ``offload_params``
    (stage 3) the reference is the same offload without it: the parameter shards' placement
    changes no bit ([Note: parameter offload]), so the runs must be bit-identical."""
    with _folder() as folder:
        extra = {} if kind == "cpu" else {"nvme_master": nvme_master}
        models, opts = [], []
        ref_kw = _offload_kw(kind, folder, **extra) if offload_params else {}
        sub_kw = {**_offload_kw(kind, folder, **extra),
                  **({"offload_params": True} if offload_params else {})}
        for kw in (ref_kw, sub_kw):
            m = make_model()
            models.append(m)
            opts.append(zk.ZeroOptimizer(m, stage=stage, lr=LR, betas=BETAS, eps=EPS,
                                         weight_decay=WD, param_dtype=param_dtype,
                                         max_grad_norm=clip, bucket_bytes=SMALL_BUCKET, **kw))
        exact = _same_backend(*opts) if not offload_params else True
        for step, batch in enumerate(make_batches(steps, ws * micro * MICRO_BATCH)):
            losses = []
            for m, o in zip(models, opts):
                total = 0.0
                for k in range(micro):
                    ctx = o.no_sync() if k < micro - 1 else contextlib.nullcontext()
                    with ctx:
                        loss = m(*chunk(batch, rank * micro + k)) / micro
                        o.backward(loss)
                    total += loss.item()
                o.step()
                o.zero_grad()
                losses.append(total)
            assert losses[0] == losses[1] if exact else abs(losses[0] - losses[1]) < 1e-4
            with opts[0].gathered(), opts[1].gathered():  # stage 3: full parameters
                _compare(models[1], models[0], step, exact, param_dtype or torch.float32)
        sd_dev, sd_off = opts[0].state_dict(), opts[1].state_dict()
        for i, s in sd_dev["state"].items():
            for k in ("master", "exp_avg", "exp_avg_sq"):
                a, b = s[k], sd_off["state"][i][k]
                if exact:
                    assert torch.equal(a, b), (i, k)
                else:
                    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
            assert s["step"] == sd_off["state"][i]["step"] == steps
        st = opts[1].stats()["offload"]
        assert st["kind"] == kind and st["device_to_host_bytes"] > 0
        if offload_params:
            # The update writes the host shards: nothing goes up in step(); every gather
            # brought its shard in instead: two per unit per micro-step (forward, backward),
            # plus the previous step's opt.gathered() above.
            shard_bytes = sum(u.layout.shard_numel * u.compute_shard.element_size()
                              for u in opts[1].units)
            assert st["host_to_device_bytes"] == 0, st
            assert st["param_host_to_device_s"] > 0
            assert 0 <= st["param_host_to_device_hidden_s"] <= st["param_host_to_device_s"]
            assert st["param_host_to_device_bytes"] == (2 * micro + 1) * shard_bytes, \
                (st, shard_bytes)
            opts[0].close()
        else:
            assert st["host_to_device_bytes"] > 0
        if kind == "nvme":
            assert st["disk_read_bytes"] == st["disk_write_bytes"] > 0
            # I/O time measured per request; the part not waited for is reported as hidden
            assert st["disk_io_s"] > 0 and 0 <= st["disk_io_hidden_s"] <= st["disk_io_s"]
        opts[1].close()


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


def params_leave_the_device(rank, ws, *, kind, param_dtype):
    """Stage 3 ``offload_params``: between uses the device holds ~0 parameter bytes (measured
    from the storages: exactly 0 here, every parameter is trainable), while inside a unit's
    forward its parameters are there; the shards are in host RAM instead (stats() moves them
    from device to host, byte for byte against the same run without offload_params), and
    estimate_memory says the same."""
    with _folder() as folder:
        runs = []
        for op in (False, True):
            model = make_model()
            kw = {**_offload_kw(kind, folder), "offload_params": op}
            opt = zk.ZeroOptimizer(model, stage=3, lr=LR, eps=EPS, param_dtype=param_dtype,
                                   **kw)
            inside = []
            block = model.blocks[0]
            # after the schedule's pre-hook (registered first): the unit is gathered here
            h = block.register_forward_pre_hook(
                lambda m, a, opt=opt, model=model: inside.append(
                    _device_param_bytes(opt, model)))
            for batch in make_batches(2, ws * MICRO_BATCH):
                opt.backward(model(*chunk(batch, rank)))
                opt.step()
                opt.zero_grad()
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
        staging = sum(t.untyped_storage().nbytes()
                      for t in o0.shard_update.held_host().get("buffers", [])) \
            if kind == "cpu" else 0   # cpu offload's staging goes: the update writes the shard
        master = shard_bytes if (kind == "cpu" and param_dtype is None) else 0  # fp32: one copy
        assert w1["host"] - w0["host"] == shard_bytes - staging - master, (w0, w1, shard_bytes)
        assert st1["memory_bytes"]["params"] == shard_bytes
        fresh = make_model()   # the optimizer's model has empty (sharded) parameters now
        est = zk.estimate_memory(fresh, ws, 3, param_dtype=param_dtype, offload=kind,
                                 offload_params=True, nvme_buffer_bytes=NVME_BUDGET,
                                 sub_group_numel=CPU_SUB)
        est0 = zk.estimate_memory(fresh, ws, 3, param_dtype=param_dtype, offload=kind,
                                  nvme_buffer_bytes=NVME_BUDGET, sub_group_numel=CPU_SUB)
        numel = sum(p.numel() for p in fresh.parameters())
        p = (param_dtype or torch.float32).itemsize
        assert est0.held_device_bytes - est.held_device_bytes == p * -(-numel // ws)
        assert abs(est.params_bytes - shard_bytes) <= 0.02 * shard_bytes
        o0.close()
        o1.close()


def nvme_budget_and_disk(rank, ws, *, nvme_master):
    """Host RAM held by the NVMe strategy stays within its budget while the files hold the
    whole state: 8 (moments) or 12 (with master) bytes per element of this rank's shards,
    measured from fstat (plus one header block per file and padding to 4096 bytes)."""
    with _folder() as folder:
        model = make_model()
        opt = zk.ZeroOptimizer(model, stage=2, lr=LR, eps=EPS, bucket_bytes=2 ** 14,
                               param_dtype=torch.bfloat16,
                               **_offload_kw("nvme", folder, nvme_master=nvme_master))
        for batch in make_batches(2, ws * MICRO_BATCH):
            opt.backward(model(*chunk(batch, rank)))
            opt.step()
            opt.zero_grad()
        st = opt.stats()
        shards = [u.layout.shard_numel for u in opt.units]
        psi_over_n = sum(shards)
        kinds = 3 if nvme_master else 2
        data = kinds * sum(round_up(n * 4) for n in shards)
        disk = st["memory_location_bytes"]["disk"]
        assert disk == data + kinds * len(shards) * HEADER_BYTES, (disk, data)
        # = 12 or 8 bytes per shard element, up to the 4096-byte padding of each file
        assert 4 * kinds * psi_over_n <= data < 4 * kinds * psi_over_n + kinds * len(shards) * 4096
        files = [os.path.join(opt.shard_update.files.folder, f)
                 for f in os.listdir(opt.shard_update.files.folder)]
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
        folder_of_run = opt.shard_update.files.folder
        opt.close()
        assert not os.path.exists(folder_of_run), "close() removes the run's folder"


def cpu_memory_by_location(rank, ws):
    """CPU offload: master, moments and the gradient shard in host RAM, measured; the device
    keeps the compute parameters and the reduce buffers only; estimate_memory agrees."""
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=2, lr=LR, eps=EPS, bucket_bytes=2 ** 14,
                           param_dtype=torch.bfloat16, **_offload_kw("cpu", None))
    for batch in make_batches(2, ws * MICRO_BATCH):
        opt.backward(model(*chunk(batch, rank)))
        opt.step()
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
    assert off["device_to_host_hidden_s"] + off["device_to_host_exposed_s"] == \
        off["device_to_host_s"] or off["device_to_host_exposed_s"] >= off["device_to_host_s"]
    est = zk.estimate_memory(model, ws, 2, param_dtype=torch.bfloat16, bucket_bytes=2 ** 14,
                             offload="cpu", sub_group_numel=CPU_SUB)
    assert abs(est.host_bytes - where["host"]) <= 0.02 * where["host"]
    assert est.host_device_bytes == 6 * -(-sum(p.numel() for p in model.parameters()) // ws)
    opt.close()


def state_round_trip(rank, ws, *, kind):
    """A state saved from an offloaded run loads into a run on the device, and the other
    way round; both continue bit-identically (same backends) to the uninterrupted run."""
    batches = make_batches(6, ws * MICRO_BATCH)
    with _folder() as folder:
        def build(kw, seed=0):
            m = make_model(seed)
            return m, zk.ZeroOptimizer(m, stage=2, lr=LR, eps=EPS, weight_decay=WD,
                                       param_dtype=torch.bfloat16, bucket_bytes=SMALL_BUCKET,
                                       **kw)

        def train(m, o, batch):
            o.backward(m(*chunk(batch, rank)))
            o.step()
            o.zero_grad()

        off = _offload_kw(kind, folder)
        for src_kw, dst_kw in ((off, {}), ({}, off)):
            m1, o1 = build(src_kw)
            for b in batches[:3]:
                train(m1, o1, b)
            buf = io.BytesIO()
            torch.save(o1.state_dict(), buf)
            trace = []
            for b in batches[3:]:
                train(m1, o1, b)
                trace.append([p.detach().clone() for p in m1.parameters()])
            m2, o2 = build(dst_kw, seed=7)
            buf.seek(0)
            o2.load_state_dict(torch.load(buf, weights_only=False))
            for b, expected in zip(batches[3:], trace):
                train(m2, o2, b)
                assert all(torch.equal(a, p) for a, p in zip(expected, m2.parameters()))
            o1.close()
            o2.close()


def close_and_reopen(rank, ws):
    """NVMe: close(keep_files=True) keeps the run folder; a new optimizer over a differently
    initialized model adopts it (OffloadConfig(resume_dir=...)) and continues exactly."""
    batches = make_batches(6, ws * MICRO_BATCH)
    with _folder() as folder:
        def build(seed, **config):
            m = make_model(seed)
            kw = _offload_kw("nvme", folder, **config)
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
    "parity_torch_cpu": partial(fp32_parity, stage=2,
                                offload_kw=_offload_kw("cpu", None)),
    "fp32_cpu": partial(against_device, kind="cpu"),
    "fp32_nvme": partial(against_device, kind="nvme"),
    "fp32_nvme_host_master": partial(against_device, kind="nvme", steps=4, nvme_master=False),
    "accumulate_clip_cpu": partial(against_device, kind="cpu", steps=6, micro=2, clip=0.05),
    "accumulate_clip_nvme": partial(against_device, kind="nvme", steps=6, micro=2, clip=0.05),
    "bf16_cpu": partial(against_device, kind="cpu", param_dtype=torch.bfloat16),
    "bf16_nvme": partial(against_device, kind="nvme", param_dtype=torch.bfloat16),
    "stage3_fp32_cpu": partial(against_device, kind="cpu", stage=3, steps=6),
    "stage3_bf16_nvme_clip": partial(against_device, kind="nvme", stage=3, steps=6,
                                     param_dtype=torch.bfloat16, clip=0.05),
    "stage3_accumulate_cpu": partial(against_device, kind="cpu", stage=3, steps=4, micro=2),
    # Stage 3 offload_params against the same offload without it: bit-identical.
    "stage3_params_fp32_cpu_accumulate_clip": partial(
        against_device, kind="cpu", stage=3, micro=2, clip=0.05, offload_params=True),
    "stage3_params_bf16_cpu_accumulate_clip": partial(
        against_device, kind="cpu", stage=3, micro=2, clip=0.05, param_dtype=torch.bfloat16,
        offload_params=True),
    "stage3_params_fp32_nvme_clip": partial(
        against_device, kind="nvme", stage=3, steps=6, clip=0.05, offload_params=True),
    "stage3_params_bf16_nvme_accumulate": partial(
        against_device, kind="nvme", stage=3, steps=6, micro=2, param_dtype=torch.bfloat16,
        offload_params=True),
    "stage3_params_leave_device_fp32_cpu": partial(params_leave_the_device, kind="cpu",
                                                   param_dtype=None),
    "stage3_params_leave_device_bf16_nvme": partial(params_leave_the_device, kind="nvme",
                                                    param_dtype=torch.bfloat16),
    "nvme_budget_disk_master": partial(nvme_budget_and_disk, nvme_master=True),
    "nvme_budget_disk_moments": partial(nvme_budget_and_disk, nvme_master=False),
    "cpu_memory_by_location": cpu_memory_by_location,
    "state_dict_cpu": partial(state_round_trip, kind="cpu"),
    "state_dict_nvme": partial(state_round_trip, kind="nvme"),
    "close_and_reopen_nvme": close_and_reopen,
}


def battery(rank, world_size):
    torch.manual_seed(0)
    return run_checks(CHECKS, rank, world_size)
