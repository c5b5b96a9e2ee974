"""Low-bit optimizer state with ``offload="nvme"`` ([Note: low-bit state on NVMe] in
zkernels/zero/state/nvme_files.py): the files and slots hold bf16 moments or int8 codes and
fp32 block scales; the bytes on disk and in the arena against the formula and
estimate_memory; the step the same bits as the state in memory (one sub-group per unit and
several); a kept folder resumed bit for bit (another format refused by name); checkpoints at
another world size and stage. Parity against the oracle on ranks is the battery's
(``state=`` rows with ``offload="nvme"`` in tests/zero/_battery.py)."""
import os

import pytest
import torch

from tests._dist import run_ranks
from tests.zero.test_lowbit_checkpoint import _train  # the same batches (block 8, vocab 128)
from zkernels import ZeroOptimizer, checkpoint, estimate_memory
from zkernels.demo.model import GPT, GPTConfig
from zkernels.zero.planning.offload_config import IO_ALIGN, OffloadConfig
from zkernels.zero.planning.state_format import StateFormat, state_bytes
from zkernels.zero.state.swap import OffloadIOError

CFG = GPTConfig(vocab_size=128, block_size=8, n_layer=1, n_head=2, n_embd=64)
BLOCK = 32
FORMATS = {None: None, "bf16": StateFormat(torch.bfloat16, BLOCK),
           "int8": StateFormat("int8", BLOCK)}
# Sub-groups of 4096 elements (an aligned block of int8 codes): several per unit shard.
SMALL_BUDGET = 3 * 4096 * 16 + 2 * IO_ALIGN


def _model(seed=0):
    torch.manual_seed(seed)
    return GPT(CFG)


def _nvme(folder, stage=2, state="int8", budget=None, **config):
    model = _model()
    if budget is not None:
        config["nvme_buffer_bytes"] = budget
    opt = ZeroOptimizer(model, stage=stage, lr=1e-2, state_dtype=state, state_block_size=BLOCK,
                        offload="nvme", offload_dir=str(folder),
                        offload_config=OffloadConfig(**config))
    return model, opt


def _params(model, opt):
    with opt.gathered():
        return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("budget", [None, SMALL_BUDGET], ids=["one-sub-group", "several"])
@pytest.mark.parametrize("state", ["bf16", "int8"])
def test_files_hold_the_state_as_trained(tmp_path, state, budget):
    """The swap files are of the format's dtypes and sizes, stats() and estimate_memory say
    the same bytes, and the step gives the same bits as the state in memory (the host OpSet
    either way)."""
    model, opt = _nvme(tmp_path, state=state, budget=budget)
    _train(model, opt, 3)
    fmt = FORMATS[state]
    eng = opt.shard_update
    if budget is not None:   # several sub-groups of the largest shard, each whole blocks
        assert eng.place.sub_group_numel < max(u.layout.shard_numel for u in opt.units)
        assert eng.place.sub_group_numel % 4096 == 0
    data = files = 0
    for rec in eng.states:
        n = rec.numel
        want = {"master": (n, torch.float32)}
        if state == "bf16":
            want.update(exp_avg=(n, torch.bfloat16), exp_avg_sq=(n, torch.bfloat16))
        else:
            nb = -(-n // BLOCK)
            want.update(exp_avg=(n, torch.int8), exp_avg_sq=(n, torch.uint8),
                        exp_avg_scales=(nb, torch.float32),
                        exp_avg_sq_scales=(nb, torch.float32))
        assert {k: (f.numel, f.dtype) for k, f in rec.files.items()} == want
        for k, f in rec.files.items():
            assert os.path.getsize(f.path) == 4096 + -(-f.numel * f.dtype.itemsize // 4096) * 4096
            if k != "master":
                data += f.numel * f.dtype.itemsize
                files += os.path.getsize(f.path)
        assert rec.exp_avg.is_meta and rec.exp_avg.dtype == want["exp_avg"][1]
    # The moments' bytes are the formula's (fp32 8 B/element, bf16 4, int8 2 + 8/block) ...
    assert data == sum(state_bytes(u.layout.shard_numel, fmt) for u in opt.units)
    st = opt.stats()["memory_bytes_by_location"]
    assert st["disk"]["optimizer_states"] == files   # (headers and 4 KiB padding included)
    est = estimate_memory(model, 1, 2, offload="nvme", state_dtype=state,
                          state_block_size=BLOCK,
                          **({} if budget is None else {"nvme_buffer_bytes": budget}))
    assert abs(est.by_location["disk"]["optimizer_states"] - data) <= 0.03 * data
    # ... and the slot arena is the estimate's (narrower moments, the scales beside them).
    assert st["host"]["buffers"] == est.by_location["host"]["staging"]
    opt.close()
    # The same bits as the moments in host RAM (CPU offload: the host OpSet too).
    twin = _model()
    ref = ZeroOptimizer(twin, stage=2, lr=1e-2, state_dtype=state, state_block_size=BLOCK,
                        offload="cpu")
    _train(twin, ref, 3)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    ref.close()


def test_disk_and_slots_shrink_with_the_format(tmp_path):
    """A 1M-parameter layer (the files' 4 KiB headers are noise): the moments on disk take
    8, 4 and 2 + 8/32 bytes per parameter, and the slot arena within one budget holds
    sub-groups that many times longer."""
    disk, sub = {}, {}
    for state in (None, "bf16", "int8"):
        model = torch.nn.Linear(1024, 1024, bias=False)
        opt = ZeroOptimizer(model, stage=2, state_dtype=state, state_block_size=BLOCK,
                            offload="nvme", offload_dir=str(tmp_path / str(state)),
                            offload_config=OffloadConfig(nvme_buffer_bytes=1 << 23))
        disk[state] = opt.stats()["memory_bytes_by_location"]["disk"]["optimizer_states"]
        sub[state] = opt.shard_update.place.sub_group_numel
        opt.close()
    assert disk["bf16"] / disk[None] == pytest.approx(0.5, rel=0.01)
    assert disk["int8"] / disk[None] == pytest.approx(2.25 / 8, rel=0.01)
    # (a slot element: master 4 + moments + gradient 4 bytes, int8 also 8/32 of scales)
    assert sub["bf16"] / sub[None] == pytest.approx(16 / 12, rel=0.05)
    assert sub["int8"] / sub[None] == pytest.approx(16 / 10.25, rel=0.05)


@pytest.mark.parametrize("state", ["bf16", "int8"])
def test_kept_folder_resumes_bit_for_bit(tmp_path, state):
    model, opt = _nvme(tmp_path / "run", state=state, budget=SMALL_BUDGET)
    _train(model, opt, 2)
    kept = opt.close(keep_files=True)
    with pytest.raises(OffloadIOError, match="a kept folder resumes its own format"):
        _nvme(tmp_path / "other", state="bf16" if state == "int8" else "int8",
              budget=SMALL_BUDGET, resume_dir=kept)
    resumed, opt2 = _nvme(tmp_path / "again", state=state, budget=SMALL_BUDGET,
                          resume_dir=kept)
    _train(resumed, opt2, 2, seed=2)
    got = _params(resumed, opt2)
    opt2.close()
    straight, opt3 = _nvme(tmp_path / "straight", state=state, budget=SMALL_BUDGET)
    _train(straight, opt3, 2)
    _train(straight, opt3, 2, seed=2)
    assert all(torch.equal(p, q) for p, q in zip(_params(straight, opt3), got))
    opt3.close()


def _save_on_ranks(rank, ws, path, folder):
    model, opt = _nvme(folder, stage=2)   # (each rank makes its own run folder in it)
    _train(model, opt, 3, rank=rank, ws=ws)
    checkpoint.save(opt, path)
    opt.close()


@pytest.mark.slow   # (two spawned ranks, then a stage-3 run: ~20 s here)
def test_checkpoint_moves_to_another_world_size_and_stage(tmp_path):
    """2 ranks at stage 2 on NVMe save; 1 rank at stage 3 on NVMe loads and saves again: the
    same codes and scales, read from and written to the files; the loaded run then steps
    as the state in memory loaded from the same checkpoint does."""
    from tests.zero.test_lowbit_checkpoint import _raw
    a, b = str(tmp_path / "two"), str(tmp_path / "one")
    run_ranks(_save_on_ranks, 2, a, str(tmp_path))
    model, opt = _nvme(tmp_path / "load", stage=3)
    checkpoint.load(opt, a)
    checkpoint.save(opt, b)
    saved, again = _raw(a), _raw(b)
    for name, (desc, (_, _, raw)) in saved.items():
        assert desc == {"dtype": "int8", "block_size": BLOCK, "code": "float8"} == again[name][0]
        for k, t in raw.items():
            assert torch.equal(t, again[name][1][2][k]), (name, k)
    _train(model, opt, 2, seed=2)
    twin = _model()
    ref = ZeroOptimizer(twin, stage=3, lr=1e-2, state_dtype="int8", state_block_size=BLOCK,
                        offload="cpu")
    checkpoint.load(ref, a)
    _train(twin, ref, 2, seed=2)
    assert all(torch.equal(p, q) for p, q in zip(_params(model, opt), _params(twin, ref)))
    opt.close()
    ref.close()
