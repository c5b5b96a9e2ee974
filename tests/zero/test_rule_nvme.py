"""offload="nvme" with a torch.optim class and the fused Lion / SGD (issue 26): the rule's
state lives in swap files and is in host RAM only for its unit's step ([Note: rule state on
NVMe] in zkernels/zero/state/rule_swap.py), with the fp32 master in RAM (nvme_master=False) or
in a file too (nvme_master=True, the default). Against one oracle, the same optimizer with
offload="cpu" (the same host arithmetic: bit for bit), at 1 and 2 ranks, stages 2 and 3;
the one-process torch.optim class (or reference Lion) as a sanity row; host RAM bounded by
one unit's state; the files counted by stats(); checkpoints in and out; refusals by name."""
import functools
import os

import pytest
import torch

import zkernels as zk
from tests.conftest import tol
from tests.zero import _rule_nvme_checks as rc
from tests.zero._battery import RefLion
from tests.zero._harness import rank_fixture
from zkernels.zero import OffloadConfig
from zkernels.zero.state.rule_swap import SwappedRule
from zkernels.zero.state.swap import OffloadIOError

ROWS = {f"{case}_s{stage}{'_master' * master}": functools.partial(
    rc.nvme_and_cpu, stage=stage, case=case, master=master)
    for case in rc.CASES for stage in (2, 3) for master in (False, True)}
ranks = rank_fixture(ROWS, timeout=300.0)


def _oracle(case):
    m = rc.model()
    opt, hp = rc.CASES[case]
    cls = RefLion if opt == "lion" else torch.optim.SGD if opt == "sgd" else opt
    rc.train(m, cls(m.parameters(), **hp))
    return [p.detach() for p in m.parameters()]


@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("row", list(ROWS))
def test_nvme_matches_cpu_offload_and_the_class(ranks, row, world_size):
    case = row.rsplit("_s", 1)[0]
    master = row.endswith("_master")
    want = _oracle(case)
    for r, got in enumerate(ranks(row, world_size)):
        got = {k: [torch.tensor(p) for p in v] if k in ("nvme", "cpu") else v
               for k, v in got.items()}
        assert got["units"] >= 2, "the row must cover several units per rank"
        for a, b in zip(got["nvme"], got["cpu"]):
            assert torch.equal(a, b), (row, r, (a - b).abs().max().item())
        for a, b in zip(got["nvme"], want):
            torch.testing.assert_close(a, b, **tol(torch.float32))
        assert got["disk"] > 0
        assert (got["disk_master"] > 0) == master


@pytest.mark.parametrize("lost", ["state", "master"])
def test_nvme_row_catches_a_lost_state(lost):
    """The state (and the master, with nvme_master) really lives in the files: zeroing one
    file's data between steps makes the NVMe run differ from the CPU run."""
    got = {}
    for offload in ("nvme", "cpu"):
        m = rc.model()
        opt = rc.build(m, 2, offload, "sgd_class", master=lost == "master")
        rc.train(m, opt, steps=2)
        if offload == "nvme":
            rule = opt.shard_update.states[0].rule
            f = rule.master_file if lost == "master" else rule.swaps["momentum_buffer"]
            fd = os.open(f.path, os.O_WRONLY)   # (not the engine's fd: it may be O_DIRECT)
            os.pwrite(fd, bytes(f.numel * 4), 4096)
            os.close(fd)
        rc.train(m, opt, steps=2, first=2)
        got[offload] = rc.params(m, opt)
        opt.close()
    assert any(not torch.equal(a, b) for a, b in zip(got["nvme"], got["cpu"]))


@pytest.mark.parametrize("master", [False, True], ids=["host_master", "disk_master"])
@pytest.mark.parametrize("case", ["sgd_class", "lion"])
def test_host_ram_holds_one_unit_and_files_are_counted(case, master):
    m = rc.model()
    opt = rc.build(m, 2, "nvme", case, master=master)
    recs = opt.shard_update.states
    assert all(isinstance(r.rule, SwappedRule) for r in recs) and len(recs) >= 2
    seen = []
    for rec in recs:
        inner = rec.rule.rule

        def spy(*a, _inner=inner, _rec=rec, _step=inner.step, **k):
            others = [t for r in recs if r is not _rec for t in r.rule.held()]
            others += [r.rule._master_buf for r in recs if r.rule._master_buf is not None
                       and r is not _rec]
            mine = _rec.rule._master_buf
            assert (mine is not None) == master   # (the master read in for this step only)
            seen.append((sum(t.numel() for t in others),
                         sum(t.numel() * 4 for t in _rec.rule.held())))
            return _step(*a, **k)
        inner.step = spy
    rc.train(m, opt, steps=2)
    assert len(seen) == 2 * len(recs)
    assert all(o == 0 for o, _ in seen), "another unit's state was in host RAM"
    assert max(h for _, h in seen) == max(r.numel for r in recs) * 4   # one key: one buffer
    assert all(r.rule._master_buf is None for r in recs)   # nothing in RAM between steps
    mem = opt.stats()["memory_bytes_by_location"]
    assert mem["host"]["optimizer_states"] == 0
    assert (mem["host"]["master"] == 0) == master
    folder = opt.shard_update.place.files.folder
    names = sorted(n for n in os.listdir(folder) if ".rule-" in n)
    key = "momentum_buffer" if case == "sgd_class" else "exp_avg"
    assert names == [f"unit{i:05d}.rule-{key}.swap" for i in range(len(recs))]
    on_disk = sum(os.path.getsize(os.path.join(folder, n)) for n in names)
    assert mem["disk"]["optimizer_states"] == on_disk >= sum(r.numel * 4 for r in recs)
    masters = sorted(n for n in os.listdir(folder) if n.endswith(".master.swap"))
    assert masters == ([f"unit{i:05d}.master.swap" for i in range(len(recs))] if master
                       else [])
    assert mem["disk"]["master"] == sum(os.path.getsize(os.path.join(folder, n))
                                        for n in masters)
    est = zk.estimate_memory(m, 1, 2, optimizer=rc.CASES[case][0], nvme_master=master,
                             optimizer_kwargs=rc.CASES[case][1], offload="nvme",
                             bucket_bytes=512).by_location
    shards = sum(r.numel * 4 for r in recs)   # (the estimate leaves out the units' padding)
    assert 0 <= shards - est["disk"]["optimizer_states"] <= 64 * len(recs)
    if master:
        assert 0 <= shards - est["disk"]["master"] <= 64 * len(recs)
        assert "master" not in est["host"]
    # one unit's state (and master) and its gradient shard
    assert est["host"]["staging"] >= max(h for _, h in seen) * (2 if master else 1)
    opt.close()


@pytest.mark.parametrize("master", [False, True], ids=["host_master", "disk_master"])
@pytest.mark.parametrize("case", ["adagrad", "sgd"])
def test_checkpoint_from_nvme_continues_with_cpu_offload(tmp_path, case, master):
    """zk.checkpoint.save of an NVMe run loads into a CPU-offload run (and an NVMe run, by
    opt.state_dict) that continue bit for bit as the NVMe run does; with nvme_master the
    master goes out of and back into its files."""
    m = rc.model()
    opt = rc.build(m, 2, "nvme", case, master=master)
    rc.train(m, opt, steps=2)
    zk.checkpoint.save(opt, str(tmp_path / "ck"))
    sd = opt.state_dict()
    rc.train(m, opt, steps=2, first=2)
    want = rc.params(m, opt)
    opt.close()
    for offload, how in (("cpu", "checkpoint"), ("nvme", "state_dict"), ("cpu", "zeroed")):
        m2 = rc.model(seed=4)
        opt2 = rc.build(m2, 3 if how == "checkpoint" else 2, offload, case, master=master)
        if how == "state_dict":
            opt2.load_state_dict(sd)
        else:
            zk.checkpoint.load(opt2, str(tmp_path / "ck"))
        if how == "zeroed":
            for rec in opt2.shard_update.states:
                for t in rec.rule.flat.values():
                    t.zero_()
        rc.train(m2, opt2, steps=2, first=2)
        got = rc.params(m2, opt2)
        same = all(torch.equal(a, b) for a, b in zip(got, want))
        assert same != (how == "zeroed"), (offload, how)
        opt2.close()


@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", ["sgd_class", "adagrad", "lion"])
def test_kept_folder_resumes(case, stage):
    """close(keep_files=True) + OffloadConfig(resume_dir=...): the new run starts at the kept
    parameters and continues bit for bit as the uninterrupted run ([Note: rule state on
    NVMe]: the files, and the RAM state in the manifest)."""
    resumed, at_close, end, want = rc.kept_and_resumed(case, stage)
    assert all(torch.equal(a, b) for a, b in zip(resumed, at_close))
    for a, b in zip(end, want):
        assert torch.equal(a, b), (a - b).abs().max().item()


def test_kept_folder_check_can_fail():
    """The manifest's RAM state is what resumes the momentum: dropped, the run differs."""
    _, _, end, want = rc.kept_and_resumed("sgd_class", 2, forget=True)
    assert not all(torch.equal(a, b) for a, b in zip(end, want))


def test_refused_by_name(tmp_path):
    m = rc.model()
    opt = rc.build(m, 2, "nvme", "sgd_class")   # (nvme_master=False: the master in RAM)
    rc.train(m, opt, steps=1)
    with pytest.raises(ValueError, match=r"keep_files=True\) needs OffloadConfig\(nvme_master"):
        opt.close(keep_files=True)
    opt.close()
    opt = rc.build(rc.model(), 2, "nvme", "lion", master=True)
    kept = opt.close(keep_files=True)
    with pytest.raises(OffloadIOError, match=r"unit 0 was kept by lion, this optimizer runs SGD"):
        rc.build(rc.model(), 2, "nvme", "sgd_class", master=True,
                 offload_config=OffloadConfig(resume_dir=kept))


@pytest.mark.parametrize("master", [False, True], ids=["host_master", "disk_master"])
@pytest.mark.parametrize("variant", ["mixed_groups", "bf16", "offload_params", "unused"])
def test_nvme_variants_match_cpu_offload(variant, master):
    """An SGD group beside a fused AdamW group (the AdamW files stream past the rule's
    units), bf16 compute parameters, stage 3's parameter files, a parameter without a
    gradient at one step: the same parameters as offload="cpu", bit for bit."""
    got = {}
    for offload in ("nvme", "cpu"):
        m = rc.model()
        kw = dict(optimizer=torch.optim.SGD, lr=0.05, momentum=0.9)
        if variant == "mixed_groups":
            kw = dict(param_groups=[{"params": list(m[0].parameters()), "lr": 1e-2},
                                    {"params": list(m[2].parameters()),
                                     "optimizer": torch.optim.SGD, "lr": 0.05,
                                     "momentum": 0.9}])
        stage = 3 if variant == "offload_params" else 2
        cut = dict(units=[torch.nn.Linear]) if stage == 3 else dict(bucket_bytes=512)
        extra = dict(offload_dir=rc.tempfile.mkdtemp(),
                     offload_config=rc.MASTER if master else rc.NVME) \
            if offload == "nvme" else {}
        opt = zk.ZeroOptimizer(m, stage=stage, offload=offload, **cut, **extra, **kw,
                               param_dtype=torch.bfloat16 if variant == "bf16" else None,
                               offload_params=variant == "offload_params")
        for s in range(3):
            x = torch.randn(6, 12, generator=torch.Generator().manual_seed(50 + s))
            opt.zero_grad()
            if variant == "unused" and s == 1:   # layer 0 has no gradient at step 1
                h = torch.relu(x @ m[0].weight.detach().t() + m[0].bias.detach())
                loss = m[2](h).pow(2).mean()
            else:
                loss = m(x.to(torch.bfloat16) if variant == "bf16" else x).float().pow(2).mean()
            loss.backward()
            opt.step()
        got[offload] = rc.params(m, opt)
        if offload == "nvme":
            if variant == "mixed_groups":   # an AdamW unit right before a rule's unit
                rules = [r.rule is None for r in opt.shard_update.states]
                assert any(a and not b for a, b in zip(rules, rules[1:])), rules
            kinds = {n.split(".")[1] for n in os.listdir(opt.shard_update.place.files.folder)
                     if n.endswith(".swap")}
            assert "rule-momentum_buffer" in kinds
            assert ("exp_avg" in kinds) == (variant == "mixed_groups")
        opt.close()
    for a, b in zip(got["nvme"], got["cpu"]):
        assert torch.equal(a, b), (variant, (a.float() - b.float()).abs().max().item())


def test_ladder_offers_nvme_rungs_to_every_optimizer():
    """stage="auto"'s NVMe rungs keep the master on disk, which the element-wise optimizers
    now run; Muon keeps its shard master in host RAM there."""
    from zkernels.zero.planning.ladder import choose_rung
    psi, budget = 10 ** 9, 2 ** 30   # 1 GiB per rank, of device and host: NVMe rungs only
    for opt, kw in (("sgd", {"momentum": 0.9}), (torch.optim.Adagrad, {}),
                    (torch.optim.Muon, {})):
        (stage, offload), est, _ = choose_rung(psi, 8, budget, optimizer=opt,
                                               host_budget_bytes=budget, optimizer_kwargs=kw)
        assert offload == "nvme", (opt, stage)
        on_disk = est.by_location["disk"].get("master", 0) > 0
        assert on_disk == (opt is not torch.optim.Muon), opt


@pytest.mark.parametrize("master", [False, True], ids=["host_master", "disk_master"])
def test_model_load_state_dict_mid_run_reaches_the_files(master):
    """model.load_state_dict between steps writes the master (in its file with nvme_master)
    and keeps the class's state: the run goes on bit for bit as offload="cpu"."""
    new = {k: v + 0.25 for k, v in rc.model(seed=7).state_dict().items()}
    got = {}
    for offload in ("nvme", "cpu"):
        m = rc.model()
        opt = rc.build(m, 2, offload, "sgd_class", master=master)
        rc.train(m, opt, steps=2)
        m.load_state_dict(new)
        rc.train(m, opt, steps=2, first=2)
        got[offload] = rc.params(m, opt)
        opt.close()
    for a, b in zip(got["nvme"], got["cpu"]):
        assert torch.equal(a, b), (a - b).abs().max().item()
    start = [v for v in new.values()]
    assert all(not torch.equal(a, b) for a, b in zip(got["nvme"], start))


MATRIX_ROWS = {f"{kind}_s{stage}": functools.partial(rc.matrix_nvme_and_cpu, stage=stage,
                                                      kind=kind)
               for kind in ("muon", "adafactor") for stage in (2, 3)}
matrix_ranks = rank_fixture(MATRIX_ROWS, name="matrix_ranks", timeout=400.0)


@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("row", list(MATRIX_ROWS))
def test_matrix_nvme_matches_cpu_offload(matrix_ranks, row, world_size):
    """Muon / Adafactor on NVMe ([Note: whole matrices on NVMe]): the same parameters as
    offload="cpu" bit for bit, each owner's whole tensors in files (none in RAM between
    steps), and a checkpoint of the NVMe run continues bit for bit with CPU offload."""
    res = matrix_ranks(row, world_size)
    assert sum(r["owned"] for r in res) == 3   # (the model's 3 matrices, each owned once)
    for r, got in enumerate(res):
        for a, b in zip(got["nvme"], got["cpu"]):
            assert torch.equal(torch.tensor(a), torch.tensor(b)), (row, r)
        # (stage 3, one unit per Linear: the matrices' units follow the fused AdamW's bias
        # units, whose pieces once rebound the loader's saved fields, so the momentum and
        # factors of all but the first matrix loaded as nothing)
        for a, b in zip(got["resumed"], got["nvme"]):
            assert torch.equal(torch.tensor(a), torch.tensor(b)), (row, r, "resumed")
        # master + each state key per owned matrix (Adafactor: row_var, col_var)
        assert got["whole_files"] == got["owned"] * (2 if row.startswith("muon") else 3)
        assert got["held"] == 0


@pytest.mark.parametrize("lost", [None, "momentum_buffer", "master"])
def test_matrix_nvme_holds_one_matrix_and_catches_a_lost_file(lost):
    """Muon on NVMe: while the class steps one matrix, every other owned matrix is a 4-byte
    placeholder (its whole master and momentum in files only); zeroing one whole-matrix file
    between steps makes the run differ from CPU offload (the files are the state)."""
    from tests.zero import _matrix_checks as mc
    got = {}
    for offload in ("nvme", "cpu"):
        m = mc.model()
        extra = dict(offload_dir=rc.tempfile.mkdtemp()) if offload == "nvme" else {}
        opt = zk.ZeroOptimizer(m, stage=2, offload=offload, bucket_bytes=512,
                               param_groups=mc.groups(m, "muon"), **extra)
        mc.train(m, opt, 0, 0, 1)
        if offload == "nvme":
            mat = opt.shard_update.matrix
            inner = mat.inner[0]
            real = []

            def spy(*a, _step=inner.step, **k):
                real.append(sum(w.stride() != (0, 0) for w in mat.whole.values()))
                return _step(*a, **k)
            inner.step = spy
            if lost is not None:
                f = mat.store.swaps[(0, lost)]
                fd = os.open(f.path, os.O_WRONLY)   # (not the engine's fd: maybe O_DIRECT)
                os.pwrite(fd, bytes(f.numel * 4), 4096)
                os.close(fd)
        for s in (1, 2):
            mc.train(m, opt, s, 0, 1)
        got[offload] = rc.params(m, opt)
        if offload == "nvme":
            assert real == [1] * (2 * len(mat.owned())), real
            assert all(w.stride() == (0, 0) for w in mat.whole.values())   # between steps
            # the matrix units' shard masters stay in host RAM, counted by stats()
            host = opt.stats()["memory_bytes_by_location"]["host"]
            assert host["master"] == sum(r.numel * 4 for r in opt.shard_update.states
                                         if r.rule is not None) > 0
        opt.close()
    same = all(torch.equal(a, b) for a, b in zip(got["nvme"], got["cpu"]))
    assert same == (lost is None), lost


@pytest.mark.parametrize("kind", ["muon", "adafactor"])
def test_matrix_nvme_state_dict_round_trip(kind):
    """opt.state_dict() of an NVMe Muon/Adafactor run (the owner's class format, read from
    the files) and model.load_state_dict load into a fresh NVMe run (written to its files)
    that continues bit for bit as the first one does."""
    from tests.zero import _matrix_checks as mc

    def build(m):
        return zk.ZeroOptimizer(m, stage=2, offload="nvme", offload_dir=rc.tempfile.mkdtemp(),
                                bucket_bytes=512, param_groups=mc.groups(m, kind))
    m = mc.model()
    opt = build(m)
    for s in range(2):
        mc.train(m, opt, s, 0, 1)
    sd, weights = opt.state_dict(), {k: v.clone() for k, v in m.state_dict().items()}
    assert any(sd["state"].values())
    for s in (2, 3):
        mc.train(m, opt, s, 0, 1)
    want = rc.params(m, opt)
    opt.close()
    m2 = mc.model(seed=5)
    opt2 = build(m2)
    m2.load_state_dict(weights)
    opt2.load_state_dict(sd)
    for s in (2, 3):
        mc.train(m2, opt2, s, 0, 1)
    for a, b in zip(rc.params(m2, opt2), want):
        assert torch.equal(a, b), (a - b).abs().max().item()
    opt2.close()
