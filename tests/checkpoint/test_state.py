"""Single-process round trips of what a checkpoint carries besides the shards: the fp16 loss
scaler, scheduler hyper-parameters, ``model_extra`` of every storable kind, and a parameter
that was trainable when saved and is frozen now."""
import math

import torch
from torch.optim.lr_scheduler import LambdaLR

import zkernels as zk
from tests.zero._harness import make_model


def _step(model, opt, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 97, (2, 13), generator=g)
    loss = model(x, x)
    opt.backward(loss)
    opt.step()
    opt.zero_grad()


def test_fp16_loss_scaler_and_counters(tmp_path):
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=2, param_dtype=torch.float16, bucket_bytes=3000)
    for i in range(3):
        _step(model, opt, i)
    # counters no run of 3 clean steps reaches, set through the declared view
    opt.load_counters({**opt.counters(), "overflow_skips": 1,
                       "loss_scaler": {"scale": 1024.0, "clean_steps": 2}})
    zk.checkpoint.save(opt, tmp_path / "ck")
    model2 = make_model(5)
    opt2 = zk.ZeroOptimizer(model2, stage=1, param_dtype=torch.float16, bucket_bytes=5000)
    zk.checkpoint.load(opt2, tmp_path / "ck")
    assert (opt2.scaler.scale, opt2.scaler.clean_steps) == (1024.0, 2)
    assert opt2.stats()["step"] == 3 and opt2.stats()["overflow_skips"] == 1
    for p, q in zip(model.parameters(), model2.parameters()):
        assert q.dtype == torch.float16 and torch.equal(p, q)
    # The fp32 masters came back too, not a rounding of the fp16 copy.
    ours = torch.cat([z.read_state()[1][0] for z in opt.zero_units])
    theirs = zk.checkpoint.consolidate(tmp_path / "ck")
    assert not torch.equal(ours, ours.half().float())
    assert torch.equal(theirs["wte.weight"].half(), model2.wte.weight)


def test_scheduler_hparams_and_model_extra(tmp_path):
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=2, lr=1e-2, bucket_bytes=3000)
    sched = LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for i in range(3):
        _step(model, opt, i)
        sched.step()
    extra = {"sched": sched.state_dict(), "tuple": (1, "a", None), 3: "int key",
             "nested": [{"__tensor__": "not a tag"}], "inf": math.inf,
             "rng": torch.get_rng_state(), "bf16": torch.arange(4).bfloat16()}
    zk.checkpoint.save(opt, tmp_path / "ck", model_extra=extra)
    model2 = make_model(1)
    opt2 = zk.ZeroOptimizer(model2, stage=2, lr=1.0, bucket_bytes=3000)
    sched2 = LambdaLR(opt2, lambda s: 1.0 / (1 + s))
    got = zk.checkpoint.load(opt2, tmp_path / "ck")
    sched2.load_state_dict(got["sched"])
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 1e-2 / 4
    assert opt2.param_groups[0]["initial_lr"] == 1e-2
    assert isinstance(opt2.param_groups[0]["betas"], tuple)
    assert got["tuple"] == (1, "a", None) and got[3] == "int key"
    assert got["nested"] == [{"__tensor__": "not a tag"}] and got["inf"] == math.inf
    assert torch.equal(got["rng"], extra["rng"]) and got["bf16"].dtype == torch.bfloat16
    assert torch.equal(got["bf16"], extra["bf16"])
    _step(model, opt, 9)
    _step(model2, opt2, 9)
    sched.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def test_trainable_then_frozen_now(tmp_path):
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=2, bucket_bytes=3000)
    _step(model, opt)
    zk.checkpoint.save(opt, tmp_path / "ck")
    model2 = make_model(3)
    model2.wpe.weight.requires_grad_(False)   # fine-tune with the positions frozen
    opt2 = zk.ZeroOptimizer(model2, stage=2, bucket_bytes=3000)
    zk.checkpoint.load(opt2, tmp_path / "ck")
    assert torch.equal(model2.wpe.weight, model.wpe.weight)
    assert torch.equal(model2.wte.weight, model.wte.weight)
