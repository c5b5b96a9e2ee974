"""What each rank runs in test_dcp.py (module-level so spawned ranks import it).

One small MLP with a buffer (sizes that no world size here divides evenly), ``STEPS`` steps of
a global batch of ``GLOBAL`` samples, rank r of N taking its contiguous ``GLOBAL // N``, so
the mean of the ranks' losses is the global batch's loss at any world size. FSDP2 runs it as
``fully_shard`` on each Linear and on the root (gloo, CPU) with ``torch.optim.AdamW``; ours
as a ``ZeroOptimizer`` with the same hyper-parameters.
"""
import torch
import torch.nn.functional as F

GLOBAL, STEPS, SAVE_AFTER = 12, 6, 3
LR, BETAS, EPS, WD = 0.01, (0.9, 0.99), 1e-6, 0.01


def make_model(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 15), torch.nn.Tanh(),
                                torch.nn.Linear(15, 7), torch.nn.Tanh(), torch.nn.Linear(7, 4))
    model.register_buffer("seen", torch.zeros(3, dtype=torch.int64))
    return model


def batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(GLOBAL, 8, generator=g), torch.randn(GLOBAL, 4, generator=g))
            for _ in range(STEPS)]


def step(model, opt, i, rank, world):
    assert GLOBAL % world == 0, f"world size {world} does not divide the global batch"
    per = GLOBAL // world
    x, y = batches()[i]
    loss = F.mse_loss(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
    opt.zero_grad()
    loss.backward()
    opt.step()
    model.seen += 1
    return loss.item()


def _fsdp(seed, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = make_model(seed)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    return model, opt


def _full(model):
    return {n: p.full_tensor().detach().clone().numpy() for n, p in model.named_parameters()}


def fsdp_run(rank, world, ckpt, resume=False):
    """FSDP2: ``STEPS`` steps saving ``get_state_dict`` with ``dcp.save`` after
    ``SAVE_AFTER`` (``resume``: build from another seed, ``dcp.load`` + ``set_state_dict``,
    run the rest). This rank's losses, the full parameters at the save (or load), the
    AdamW state after it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model, opt = _fsdp(1 if resume else 0, world)
    out = {"losses": []}
    if resume:
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=ckpt)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        out["at_save"] = _full(model)
        out["steps"] = sorted({int(s["step"].item()) for s in opt.state.values()})
        out["lr"] = opt.param_groups[0]["lr"]
        out["seen"] = model.seen.tolist()
    for i in range(SAVE_AFTER if resume else 0, STEPS):
        if i == SAVE_AFTER and not resume:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
            out["at_save"] = _full(model)
        out["losses"].append(step(model, opt, i, rank, world))
    return out


def _ours(seed, stage, offload, lr=LR, shard_size=None):
    import zkernels as zk
    model = make_model(seed)
    opt = zk.ZeroOptimizer(model, stage=stage, lr=lr, betas=BETAS, eps=EPS, weight_decay=WD,
                           offload=offload, ops_backend="reference", shard_size=shard_size)
    return model, opt


def _masters(opt):
    from zkernels.checkpoint._view import OptimizerView
    return {n: t.clone().numpy() for n, t in OptimizerView(opt).full_units()}


def zk_import(rank, world, stage, ckpt, offload=None, catches=False):
    """Ours from the FSDP2 checkpoint (another seed and lr: every value must come from it):
    the imported masters, this rank's pieces' steps and whether their exp_avg_sq is positive,
    what import_dcp returned, and the losses of the remaining steps. ``catches``: also the
    losses of the same import with its moments and steps zeroed (the broken variant the
    curve check must catch), under ``"dropped"``."""
    from zkernels.checkpoint import _dcp_io, import_dcp
    from zkernels.checkpoint._view import OptimizerView
    model, opt = _ours(1, stage, offload, lr=0.5)
    read, real = [0], _dcp_io.SafeReader._slice_file

    def counted(self, file, sinfo):     # the bytes DCP reads from the .distcp files
        read[0] += sinfo.length
        return real(self, file, sinfo)
    _dcp_io.SafeReader._slice_file = counted
    try:
        got = import_dcp(opt, ckpt)
    finally:
        _dcp_io.SafeReader._slice_file = real
    view = OptimizerView(opt)
    pieces = [(p.step, bool((p.tensors["exp_avg_sq"] > 0).all())) for p in view.pieces()]
    view.finish_load()
    out = {"masters": _masters(opt), "pieces": pieces, "returned": got, "read": read[0],
           "lr": opt.param_groups[0]["lr"], "seen": model.seen.tolist(),
           "losses": [step(model, opt, i, rank, world) for i in range(SAVE_AFTER, STEPS)]}
    if catches:
        model, opt = _ours(1, stage, offload, lr=0.5)
        import_dcp(opt, ckpt)
        view = OptimizerView(opt)
        view.set_steps({n: 0 for n in view.params})
        for p in view.pieces():
            p.tensors["exp_avg"].zero_()
            p.tensors["exp_avg_sq"].zero_()
        view.finish_load()
        out["dropped"] = [step(model, opt, i, rank, world) for i in range(SAVE_AFTER, STEPS)]
    return out


def zk_export(rank, world, stage, ckpt, offload=None, shard_size=None):
    """Ours, uninterrupted, with ``export_dcp`` after ``SAVE_AFTER`` steps: this rank's
    losses and the masters exported (``shard_size``: hybrid sharding)."""
    from zkernels.checkpoint import export_dcp
    model, opt = _ours(0, stage, offload, shard_size=shard_size)
    out = {"losses": []}
    for i in range(STEPS):
        if i == SAVE_AFTER:
            export_dcp(opt, ckpt)
            out["at_save"] = _masters(opt)
        out["losses"].append(step(model, opt, i, rank, world))
    return out
