"""zk.checkpoint.import_dcp / export_dcp: FSDP2's torch.distributed.checkpoint layout, both ways.

[Note: the tolerance of a continued FSDP2 curve]
As [Note: the tolerance of a continued DeepSpeed curve] (test_import_deepspeed.py): the
masters moved between the two are data movement and compared bit for bit; the losses after
the move are arithmetic, FSDP2 and we reducing the global batch's gradient in another order
(another world size), a few ulps per AdamW step, so rel 1e-5 over 3 steps; dropping the
moments and step count changes the second significant digit (the catches_ row).
"""
import os
import pickle

import numpy as np
import pytest
import torch

from tests._dist import run_ranks
from tests.checkpoint._dcp_ranks import (BETAS, EPS, LR, SAVE_AFTER, WD, fsdp_run, make_model,
                                         zk_export, zk_import)
import zkernels as zk
from zkernels.checkpoint import (IncompatibleCheckpointError, NotACheckpointError,
                                 UnsafeCheckpointError, export_dcp, import_dcp)

pytest.importorskip("torch.distributed.fsdp")


def _mean(out):
    return np.mean([r["losses"] for r in out], axis=0)


def _fsdp(world, ckpt, resume, timeout=300):
    # DeviceMesh keeps the process group in torch's own mesh cache past the run: FSDP2 (the
    # reference, like DeepSpeed in test_import_deepspeed.py) is not held to our teardown.
    return run_ranks(fsdp_run, world, ckpt, resume, timeout=timeout, check_teardown=False)


def _fsdp_save(tmp_path, world=2):
    ckpt = str(tmp_path / "fsdp")
    return ckpt, _fsdp(world, ckpt, False)


def _check_import(fsdp, out, ckpt):
    for n, want in fsdp[0]["at_save"].items():
        assert np.array_equal(out[0]["masters"][n], want), n
    for r in out:
        assert r["returned"]["num_steps"] == SAVE_AFTER
        assert r["returned"]["param_groups"][0]["lr"] == LR and r["lr"] == LR
        assert r["seen"] == [SAVE_AFTER] * 3
        assert all(step == SAVE_AFTER and positive for step, positive in r["pieces"])
    assert _mean(out) == pytest.approx(_mean(fsdp)[SAVE_AFTER:], rel=1e-5)


def test_fsdp2_on_2_ranks_continues_here_and_catches_dropped_moments(tmp_path):
    ckpt, fsdp = _fsdp_save(tmp_path)
    assert sorted(os.listdir(ckpt)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    out = run_ranks(zk_import, 1, 2, ckpt, "cpu", True, timeout=300)
    _check_import(fsdp, out, ckpt)
    # catches_dropped_moments: the same import with the moments and steps zeroed departs.
    dropped = np.mean([r["dropped"] for r in out], axis=0)
    assert dropped != pytest.approx(_mean(fsdp)[SAVE_AFTER:], rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("stage,world,offload", [(3, 4, None), (1, 3, None), (3, 2, "cpu")])
def test_fsdp2_checkpoint_imports_at_any_stage_and_world_size(tmp_path, stage, world, offload):
    ckpt, fsdp = _fsdp_save(tmp_path)
    out = run_ranks(zk_import, world, stage, ckpt, offload, timeout=600)
    _check_import(fsdp, out, ckpt)
    files = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt)
                if f.endswith(".distcp"))
    print(f"DCP import, stage {stage} on {world}: bytes read per rank "
          f"{[r['read'] for r in out]} of {files} in the .distcp files")
    # No rank reads every chunk (DCP reads the saved chunks a rank's boxes overlap, whole).
    assert max(r["read"] for r in out) < files


def _check_export(ours, fsdp):
    for n, want in ours[0]["at_save"].items():
        assert np.array_equal(fsdp[0]["at_save"][n], want), n
    for r in fsdp:
        assert r["steps"] == [SAVE_AFTER] and r["lr"] == LR and r["seen"] == [SAVE_AFTER] * 3
    assert _mean(fsdp) == pytest.approx(_mean(ours)[SAVE_AFTER:], rel=1e-5)


def test_export_at_stage3_with_offload_continues_under_fsdp2_on_1_rank(tmp_path):
    ckpt = str(tmp_path / "ours")
    ours = run_ranks(zk_export, 2, 3, ckpt, "cpu", timeout=300)
    fsdp = _fsdp(1, ckpt, True)
    _check_export(ours, fsdp)


@pytest.mark.slow
@pytest.mark.parametrize("stage,shard_size", [(2, None), (3, 2)])
def test_export_on_4_ranks_continues_under_fsdp2_on_3(tmp_path, stage, shard_size):
    """Also with hybrid sharding (2 replicas of 2 shards: the first replica writes)."""
    ckpt = str(tmp_path / "ours")
    ours = run_ranks(zk_export, 4, stage, ckpt, None, shard_size, timeout=600)
    fsdp = _fsdp(3, ckpt, True, timeout=600)
    _check_export(ours, fsdp)


# -- bad input, in one process (world size 1) --

def _torch_dcp(path, model, with_optim=True, unused=(), **adamw):
    """A DCP folder from a plain module and torch AdamW, one process, after one step
    (``unused``: names of parameters without a gradient in it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                            **adamw)
    model(torch.randn(2, 8)).sum().backward()
    for n, p in model.named_parameters():
        if n in unused:
            p.grad = None
    opt.step()
    msd, osd = get_state_dict(model, opt)
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"model": msd, "optim": osd} if with_optim else {"model": msd},
                 checkpoint_id=str(path), no_dist=True)
    return model, opt


def _zk(seed=1, **kw):
    return zk.ZeroOptimizer(make_model(seed), stage=1, lr=0.5, **kw)


def test_bad_input_is_named(tmp_path):
    opt = _zk()
    with pytest.raises(NotACheckpointError, match="dcp_dir .*nowhere: no such folder"):
        import_dcp(opt, str(tmp_path / "nowhere"))
    with pytest.raises(NotACheckpointError, match=r"no \.metadata file"):
        import_dcp(opt, str(tmp_path))
    _torch_dcp(tmp_path / "model_only", make_model(0), with_optim=False)
    with pytest.raises(IncompatibleCheckpointError, match="no optimizer state under 'optim'"):
        import_dcp(opt, str(tmp_path / "model_only"))
    wide = make_model(0)
    wide[4] = torch.nn.Linear(7, 5)
    _torch_dcp(tmp_path / "wide", wide)
    with pytest.raises(IncompatibleCheckpointError, match=r"4\.weight \(checkpoint \(5, 7\)"):
        import_dcp(opt, str(tmp_path / "wide"))
    _torch_dcp(tmp_path / "amsgrad", make_model(0), amsgrad=True)
    with pytest.raises(IncompatibleCheckpointError, match=r"group 0 .*'amsgrad': True"):
        import_dcp(opt, str(tmp_path / "amsgrad"))
    (tmp_path / "notdcp").mkdir()
    (tmp_path / "notdcp" / "keep.txt").write_text("mine")
    with pytest.raises(zk.checkpoint.CheckpointError, match="not a DCP folder"):
        export_dcp(opt, str(tmp_path / "notdcp"))
    assert (tmp_path / "notdcp" / "keep.txt").read_text() == "mine"
    # A .metadata naming anything outside the allow-list is refused before use.
    (tmp_path / "evil").mkdir()
    with open(tmp_path / "evil" / ".metadata", "wb") as f:
        pickle.dump(os.path.join, f)
    with pytest.raises(UnsafeCheckpointError, match=r"posixpath\.join"):
        import_dcp(opt, str(tmp_path / "evil"))


def test_bf16_run_imports_the_fp32_masters_exactly_and_exports_them(tmp_path):
    src, _ = _torch_dcp(tmp_path / "plain", make_model(0))
    opt = _zk(param_dtype=torch.bfloat16)
    assert import_dcp(opt, str(tmp_path / "plain"))["num_steps"] == 1
    from tests.checkpoint._dcp_ranks import _masters
    got = _masters(opt)
    for n, p in src.named_parameters():
        assert torch.equal(torch.from_numpy(got[n]), p.detach()), n
    assert opt.module[0].weight.dtype == torch.bfloat16
    export_dcp(opt, str(tmp_path / "back"))
    export_dcp(opt, str(tmp_path / "back"))     # an earlier export is replaced
    assert not os.path.exists(str(tmp_path / "back") + ".zk-tmp")
    again = _zk(seed=2)
    import_dcp(again, str(tmp_path / "back"))
    for n, t in _masters(again).items():
        assert np.array_equal(t, got[n]), n


def test_a_parameter_adamw_never_stepped_starts_fresh(tmp_path):
    src, _ = _torch_dcp(tmp_path / "c", make_model(0), unused=("4.weight", "4.bias"))
    opt = _zk()
    import_dcp(opt, str(tmp_path / "c"))
    from tests.checkpoint._dcp_ranks import _masters
    from zkernels.checkpoint._view import OptimizerView
    got = _masters(opt)
    for n, p in src.named_parameters():
        assert torch.equal(torch.from_numpy(got[n]), p.detach()), n
    for p in OptimizerView(opt).pieces():
        fresh = p.name.startswith("4.")
        assert p.step == (0 if fresh else 1), p.name
        assert bool((p.tensors["exp_avg_sq"] == 0).all()) == fresh, p.name


def test_stage3_frozen_parameters_go_out_and_back_in_one_process(tmp_path):
    """Stage 3 shards frozen parameters too ([Note: frozen pieces]): the export writes them
    from the shards, a plain torch module with AdamW over the trainable ones loads it as an
    FSDP2 script would, and an import at stage 2 reads them back."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from tests.checkpoint._dcp_ranks import _masters
    model = make_model(0)
    model[0].requires_grad_(False)
    opt = zk.ZeroOptimizer(model, stage=3, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    with opt.gathered():
        frozen = model[0].weight.detach().clone()
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    export_dcp(opt, str(tmp_path / "out"))
    masters = _masters(opt)
    plain = make_model(1)
    plain[0].requires_grad_(False)
    popt = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=0.5)
    msd, osd = get_state_dict(plain, popt)
    sd = {"model": msd, "optim": osd}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(sd, checkpoint_id=str(tmp_path / "out"), no_dist=True)
    set_state_dict(plain, popt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert torch.equal(plain[0].weight, frozen)
    for n, p in plain.named_parameters():
        assert torch.equal(p.detach(), frozen if n == "0.weight" else
                           torch.from_numpy(masters.get(n, p.detach().numpy()))), n
    assert {int(s["step"]) for s in popt.state.values()} == {1}
    assert popt.param_groups[0]["lr"] == LR
    back = make_model(2)
    back[0].requires_grad_(False)
    again = zk.ZeroOptimizer(back, stage=2, lr=0.5)
    import_dcp(again, str(tmp_path / "out"))
    assert torch.equal(back[0].weight, frozen)
    for n, t in _masters(again).items():
        assert np.array_equal(t, masters[n]), n
