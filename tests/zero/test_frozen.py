"""Frozen parameters: sharded at stage 3 (gathered with their unit, no gradient, no state),
whole and untouched at stages 1-2; LoRA through peft over a transformers Llama; checkpoints
across stages and world sizes. Parity over frozen layers with activation checkpointing at
every stage is the battery's rows (test_battery.py, ``frozen=True, ckpt=...``)."""
import io

import pytest
import torch

import zkernels as zk
from tests._dist import run_ranks
from tests.zero import _frozen_checks as fc
from tests.zero._harness import LR, freeze_layers, make_model, variant

pytest.importorskip("transformers")
pytest.importorskip("peft")


def test_lora_at_stage3_holds_a_shard_of_the_frozen_base():
    """2 gloo ranks: parity with torch.optim.AdamW and bytes per rank within
    4 * frozen / N + 20 B per trainable parameter + 256 KiB (measured, see
    ``_frozen_checks.lora_bytes``), below the 4 * frozen bytes of a whole frozen base."""
    per_rank = run_ranks(fc.lora_parity, 2, timeout=600.0)
    for rank, lora in enumerate(per_rank):
        assert lora["bytes"] <= lora["bound"], lora
        assert lora["bound"] < lora["frozen_whole_bytes"], "the bound must exclude a whole base"
        print(f"rank {rank}: {lora['bytes']} B held (bound {lora['bound']} B; frozen "
              f"{lora['frozen']}, trainable {lora['trainable']}): {lora['stats']}")


@pytest.mark.slow  # three spawns; the bf16 round trip stays in the quick suite
def test_checkpoint_stage3_two_ranks_to_stage1_one_rank_and_back(tmp_path):
    """Saved at stage 3 on 2 ranks (frozen parameters written from their shards), loaded at
    stage 1 on one rank, consolidated: every key bit for bit, frozen ones included; then saved
    at stage 1 on one rank and loaded at stage 3 on 2 ranks (read into the shards), and at
    stage 3 on one rank."""
    a = str(tmp_path / "a")
    states = [_unpack(s) for s in run_ranks(_save3, 2, a, timeout=300.0)]
    assert all(set(s) == set(states[0]) for s in states)
    expected = states[0]
    for k, v in expected.items():
        assert torch.equal(states[1][k], v), k
    full = zk.checkpoint.consolidate(a)
    assert set(full) == set(expected)
    for k, v in expected.items():
        assert full[k].dtype == v.dtype and torch.equal(full[k], v), f"consolidate: {k}"
    assert fc.ckpt_load(0, 1, a, stage=1, expected=expected) == "ok"
    assert fc.ckpt_load(0, 1, a, stage=3, expected=expected) == "ok"

    b = str(tmp_path / "b")
    expected = fc.ckpt_save(0, 1, b, stage=1)
    assert run_ranks(_load3, 2, b, _pack(expected), timeout=300.0) == ["ok", "ok"]


# Tensors cross the process boundary as torch.save bytes (a tensor put on a multiprocessing
# queue lives in the sender's shared memory, gone once the rank exits).
def _pack(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _unpack(data):
    return torch.load(io.BytesIO(data), weights_only=True)


def _save3(rank, ws, folder):
    return _pack(fc.ckpt_save(rank, ws, folder, stage=3))


def _load3(rank, ws, folder, expected):
    return fc.ckpt_load(rank, ws, folder, stage=3, expected=_unpack(expected))


def test_frozen_units_structure_stats_and_state_dict():
    """One process, stage 3: each unit's frozen parameters are one flat unit per dtype (the
    compute copy: param_dtype for fp32 ones, else their own), outside ``opt.units`` and the
    optimizer state; ``stats()`` counts their shards as params; ``model.state_dict()`` inside
    ``gathered()`` (and ``gathered(module=)`` of a frozen block) holds them whole."""
    model = freeze_layers(make_model())
    before = fc._frozen(model)
    opt = zk.ZeroOptimizer(model, stage=3, lr=LR, param_dtype=torch.bfloat16)
    assert {u.compute_dtype for u in opt.frozen_units} == {torch.bfloat16}
    assert len(opt.shard_update.states) == len(opt.units)
    assert not any(u.frozen for u in opt.units) and all(u.frozen for u in opt.frozen_units)
    frozen_numel = sum(v.numel() for v in before.values())
    shard_numel = sum(u.layout.shard_numel for u in opt.frozen_units)
    assert frozen_numel <= shard_numel < frozen_numel + 64 * len(opt.frozen_units)
    trainable_bytes = sum(u.compute_shard.numel() * 2 for u in opt.units)
    assert opt.stats()["memory_bytes"]["params"] == trainable_bytes + 2 * shard_numel
    with opt.gathered(module=model.blocks[0]):
        assert model.blocks[0].fc.weight.dtype == torch.bfloat16
        torch.testing.assert_close(model.blocks[0].fc.weight,
                                   before["blocks.0.fc.weight"].bfloat16(), rtol=0, atol=0)
    assert model.blocks[0].fc.weight.numel() == 0
    with opt.gathered():
        sd = model.state_dict()
        for k, v in before.items():
            assert torch.equal(sd[k], v.bfloat16()), k

    # No param_dtype: a bf16 frozen parameter keeps its dtype, an fp32 one stays fp32.
    model = make_model()
    model.blocks[1].requires_grad_(False)
    model.blocks[1].fc.to(torch.bfloat16)
    want = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = zk.ZeroOptimizer(model, stage=3, lr=LR)
    dtypes = sorted(str(u.compute_dtype) for u in opt.frozen_units)
    assert dtypes == ["torch.bfloat16", "torch.float32"], dtypes
    with opt.gathered():
        for n, p in model.named_parameters():
            if n in want:
                assert p.dtype == want[n].dtype and torch.equal(p, want[n]), n


def test_stages_1_2_keep_frozen_parameters_whole():
    for stage in (1, 2):
        model = freeze_layers(make_model())
        w = model.blocks[0].fc.weight
        opt = zk.ZeroOptimizer(model, stage=stage, lr=LR)
        assert opt.frozen_units == [] and model.blocks[0].fc.weight is w
        assert w.untyped_storage().nbytes() == w.numel() * 4


def test_frozen_parameter_elsewhere_is_refused():
    model = make_model()
    model.blocks[0].requires_grad_(False)
    model.blocks[0].fc.to("meta")
    # A meta tensor without device= is refused (with it, it is materialized: test_meta_build).
    with pytest.raises(ValueError, match="'meta' device: pass device="):
        zk.ZeroOptimizer(model, stage=3, lr=LR)


def test_a_frozen_block_is_a_unit():
    """A wholly frozen block is a stage-3 unit like any other, by default and by ``units=``."""
    model = make_model()
    model.blocks[0].requires_grad_(False)
    opt = zk.ZeroOptimizer(model, stage=3, lr=LR)
    assert [u.name for u in opt.schedule.units] == ["blocks.0", "blocks.1", "<root>"]
    model = make_model()
    model.blocks[1].requires_grad_(False)
    opt = zk.ZeroOptimizer(model, stage=3, lr=LR, units=[model.blocks[1]])
    assert [[f.frozen for f in u.flats] for u in opt.schedule.units] == [[True], [False]]


@pytest.mark.parametrize("offload, offload_params", [("cpu", False), ("cpu", True),
                                                     ("nvme", True)])
def test_offload_with_frozen_shards_is_bit_identical(tmp_path, offload, offload_params):
    """Stage 3 offload (the frozen shards in host RAM with offload_params, in files with NVMe)
    trains bit for bit like stage 3 on the device; the frozen parameters come back whole and
    unchanged, in ``gathered()`` and through a checkpoint, and load back into another
    initialization from the checkpoint and from ``state_dict``."""
    def run(**kw):
        model = freeze_layers(make_model())
        before = fc._frozen(model)
        opt = zk.ZeroOptimizer(model, stage=3, lr=LR, **kw)
        losses = []
        for batch in fc.make_batches(3, 2):
            loss = model(*batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        state = fc.full_state(opt, model)
        for k, v in before.items():
            assert torch.equal(state[k], v), k
        path = str(tmp_path / f"ckpt-{len(kw)}")
        zk.checkpoint.save(opt, path)
        full = zk.checkpoint.consolidate(path)
        for k, v in before.items():
            assert torch.equal(full[k], v), k
        sd = opt.state_dict()
        opt.close()
        # The frozen shards load back (where they are on disk: through a host copy written
        # back), from the checkpoint and from state_dict, into another initialization.
        for how in ("checkpoint", "state_dict"):
            other = fc.freeze_layers(make_model(seed=5))
            opt2 = zk.ZeroOptimizer(other, stage=3, lr=LR, **kw)
            if how == "checkpoint":
                zk.checkpoint.load(opt2, path)
            else:
                opt2.load_state_dict(sd)
            loaded = fc.full_state(opt2, other)
            for k, v in state.items():
                assert torch.equal(loaded[k], v), (how, k)
            opt2.close()
        return losses, state

    losses, state = run()
    kw = dict(offload=offload, offload_params=offload_params)
    if offload == "nvme":
        kw["offload_dir"] = str(tmp_path)
    got_losses, got = run(**kw)
    assert got_losses == losses
    for k, v in state.items():
        assert torch.equal(got[k], v), k


def test_bf16_frozen_shards_round_trip_a_checkpoint(tmp_path):
    """param_dtype=bf16 at stage 3 keeps frozen shards in bf16: the checkpoint stores those
    (consolidate returns them in bf16, bit for bit) and a stage-1 fp32 model loads them
    exactly (bf16 -> fp32 is exact)."""
    model = freeze_layers(make_model())
    before = fc._frozen(model)
    opt = zk.ZeroOptimizer(model, stage=3, lr=LR, param_dtype=torch.bfloat16)
    batch = fc.make_batches(1, 2)[0]
    model(*batch).backward()
    opt.step()
    path = str(tmp_path / "c")
    zk.checkpoint.save(opt, path)
    full = zk.checkpoint.consolidate(path)
    for k, v in before.items():
        assert full[k].dtype == torch.bfloat16 and torch.equal(full[k], v.bfloat16()), k
    model2 = freeze_layers(make_model(seed=3))
    opt2 = zk.ZeroOptimizer(model2, stage=1, lr=LR)
    zk.checkpoint.load(opt2, path)
    for n, p in model2.named_parameters():
        if n in before:
            assert p.dtype == torch.float32 and torch.equal(p, before[n].bfloat16().float()), n


def test_optimizer_state_dict_carries_the_frozen_shards():
    """Stage 3's ``opt.state_dict()`` holds the frozen shards (they exist nowhere else): a
    model built with other frozen values continues bit for bit after ``load_state_dict``; a
    state without them (or for other units) is refused."""
    def build(seed):
        model = freeze_layers(make_model(seed))
        return model, zk.ZeroOptimizer(model, stage=3, lr=LR)

    model, opt = build(0)
    batches = fc.make_batches(4, 2)
    for batch in batches[:2]:
        model(*batch).backward()
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    assert sorted(sd["frozen"]) == [u.index for u in opt.frozen_units]
    model2, opt2 = build(7)
    opt2.load_state_dict(sd)
    for batch in batches[2:]:
        for m, o in ((model, opt), (model2, opt2)):
            m(*batch).backward()
            o.step()
            o.zero_grad()
    assert fc.full_state(opt, model).keys() == fc.full_state(opt2, model2).keys()
    for (k, v), w in zip(fc.full_state(opt, model).items(),
                         fc.full_state(opt2, model2).values()):
        assert torch.equal(v, w), k
    bad = dict(sd, frozen={})
    with pytest.raises(ValueError, match="frozen parameter shards do not match"):
        opt2.load_state_dict(bad)


# Reentrant checkpointing is left out of "lora_like": torch's reentrant checkpoint computes no
# gradient through a block whose inputs need none (here: a frozen embedding).
@pytest.mark.parametrize("ckpt, pattern", [
    (c, p) for c in (None, "non_reentrant", "reentrant")
    for p in ("norms", "whole_blocks", "lora_like") if (c, p) != ("reentrant", "lora_like")])
def test_backward_frees_units_holding_frozen_parameters(ckpt, pattern):
    """Six blocks: a unit holding frozen parameters is freed during backward once its inputs'
    gradients are computed (a frozen weight is needed for them after its unit's gradients are
    in), with or without activation checkpointing, so the gathered bytes never pass the
    prefetch bound (the root and two blocks), well below the whole model. (Without the
    input-gradient hooks the peak is the whole model: 378880 B here.)"""
    from zkernels.demo.model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=6, n_embd=32, tie_weights=False))
    variant(model, tuple(range(6)), ckpt)
    if pattern == "norms":
        for blk in model.blocks:
            blk.ln_1.requires_grad_(False)
    elif pattern == "whole_blocks":
        for blk in model.blocks[::2]:
            blk.requires_grad_(False)
    else:   # only a bias per block trains, over a frozen embedding, head and final norm
        model.requires_grad_(False)
        for blk in model.blocks:
            blk.attn.bias.requires_grad_(True)
    opt = zk.ZeroOptimizer(model, stage=3, lr=LR)
    total = sum(u.nbytes for u in opt.schedule.units)
    for batch in fc.make_batches(2, 2):
        model(*batch).backward()
        assert opt.schedule.live_bytes() == 0
        opt.step()
        opt.zero_grad()
    gather = opt.stats()["gather"]
    assert gather["peak_gathered_bytes"] <= gather["limit_bytes"] < total / 2, (gather, total)
