"""Rank bodies of tests/zero/test_rule_nvme.py: one optimizer trained with offload="nvme"
(its rule state in swap files: [Note: rule state on NVMe] in zkernels/zero/state/rule_swap.py)
and with offload="cpu" on the same data, several units per rank."""
import os
import shutil
import tempfile

import torch
import torch.nn as nn

import zkernels as zk
from zkernels.zero import OffloadConfig

LION = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
SGD = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
CASES = {
    "sgd_class": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1,
                                        weight_decay=0.01)),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.05)),
    "lion": ("lion", LION),
    "sgd": ("sgd", SGD),
}
NVME = OffloadConfig(nvme_master=False)
MASTER = OffloadConfig()   # nvme_master=True, the default: the master in a file too


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 5))


def train(m, opt, steps=3, first=0):
    for s in range(first, first + steps):
        x = torch.randn(6, 12, generator=torch.Generator().manual_seed(50 + s))
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        opt.step()


def build(m, stage, offload, case, master=False, **kw):
    """Several units per rank: small buckets at stage 2, one unit per Linear at stage 3;
    ``master``: NVMe keeps the master in files too (``nvme_master=True``)."""
    opt, hp = CASES[case]
    cut = dict(units=[nn.Linear]) if stage == 3 else dict(bucket_bytes=512)
    extra = dict(offload_dir=tempfile.mkdtemp(), offload_config=kw.pop(
        "offload_config", MASTER if master else NVME)) if offload == "nvme" else {}
    return zk.ZeroOptimizer(m, stage=stage, offload=offload, optimizer=opt, **cut, **extra,
                            **hp, **kw)


def params(m, opt):
    with opt.gathered():
        return [p.detach().clone() for p in m.parameters()]


def nvme_and_cpu(rank, world_size, stage, case, master=False):
    """Every rank trains the same batches (the mean gradient is the one-process gradient):
    the NVMe run's parameters, the CPU run's, and the NVMe run's bytes on disk."""
    out = {}
    for offload in ("nvme", "cpu"):
        m = model()
        opt = build(m, stage, offload, case, master=master)
        train(m, opt)
        out[offload] = [p.tolist() for p in params(m, opt)]   # (lists travel between ranks)
        if offload == "nvme":
            disk = opt.stats()["memory_bytes_by_location"]["disk"]
            out["disk"], out["disk_master"] = disk["optimizer_states"], disk["master"]
            out["units"] = len(opt.shard_update.states)
        opt.close()
    return out


def matrix_nvme_and_cpu(rank, world_size, stage, kind):
    """Muon / Adafactor (on the matrices, the fused AdamW on the rest) with offload="nvme"
    (each owner's whole master and state in files: [Note: whole matrices on NVMe]) and with
    offload="cpu", each rank its slice of the batches: both runs' parameters; the NVMe run
    saves a checkpoint after 2 steps that a CPU-offload run loads and continues from; the
    whole-matrix files on disk and the owner's whole tensors in RAM between steps."""
    from tests.zero import _matrix_checks as mc
    # (one folder for the ranks of this run: they share the spawning process)
    spawner = os.getppid() if world_size > 1 else os.getpid()
    folder = os.path.join(tempfile.gettempdir(), f"zk-matrix-nvme-{spawner}-{stage}-{kind}")
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)   # (the first step is collective: after it)
    out = {}
    for offload in ("nvme", "cpu"):
        m = mc.model()
        cut = dict(units=[nn.Linear]) if stage == 3 else dict(bucket_bytes=512)
        extra = dict(offload_dir=tempfile.mkdtemp()) if offload == "nvme" else {}
        opt = zk.ZeroOptimizer(m, stage=stage, offload=offload, param_groups=mc.groups(m, kind),
                               **cut, **extra)
        for s in range(4):
            mc.train(m, opt, s, rank, world_size)
            if offload == "nvme" and s == 1:
                zk.checkpoint.save(opt, folder)
        out[offload] = [p.tolist() for p in params(m, opt)]
        if offload == "nvme":
            files = [n for n in os.listdir(opt.shard_update.place.files.folder) if ".whole" in n]
            out["whole_files"] = len(files)
            out["owned"] = len(opt.shard_update.matrix.owned())
            out["held"] = sum(len(opt.shard_update.matrix.held(r.unit.index))
                              for r in opt.shard_update.states if r.rule is not None)
        opt.close()
    m = mc.model(seed=3)
    opt = zk.ZeroOptimizer(m, stage=stage, offload="cpu", param_groups=mc.groups(m, kind),
                           **(dict(units=[nn.Linear]) if stage == 3 else dict(bucket_bytes=512)))
    zk.checkpoint.load(opt, folder)
    for s in (2, 3):
        mc.train(m, opt, s, rank, world_size)
    out["resumed"] = [p.tolist() for p in params(m, opt)]
    opt.close()
    return out


def kept_and_resumed(case, stage, forget=False):
    """Train 3 steps with the master on NVMe, ``close(keep_files=True)``, resume the folder
    in a new optimizer over other initial values (``OffloadConfig(resume_dir=...)``), train 3
    more: ``(parameters right after the resume, the first run's at close, the resumed run's
    end, an uninterrupted 6-step run's end)``. ``forget``: the manifest's kept RAM state is
    dropped before the resume (each piece "no state yet": the check can fail)."""
    import json
    whole = model()
    ref = build(whole, stage, "nvme", case, master=True)
    train(whole, ref, steps=6)
    want = params(whole, ref)
    ref.close()
    m = model()
    opt = build(m, stage, "nvme", case, master=True)
    train(m, opt)
    at_close = params(m, opt)
    kept = opt.close(keep_files=True)
    if forget:
        path = os.path.join(kept, "manifest.json")
        with open(path) as f:
            man = json.load(f)
        for info in man["rules"].values():
            info["pieces"] = [None] * len(info["pieces"])
        with open(path, "w") as f:
            json.dump(man, f)
    m2 = model(seed=7)
    opt2 = build(m2, stage, "nvme", case, master=True,
                 offload_config=OffloadConfig(resume_dir=kept))
    resumed = params(m2, opt2)
    train(m2, opt2, first=3)
    out = (resumed, at_close, params(m2, opt2), want)
    opt2.close()
    shutil.rmtree(os.path.dirname(kept), ignore_errors=True)
    return out
