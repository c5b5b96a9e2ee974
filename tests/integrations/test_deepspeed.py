"""zkernels.integrations.deepspeed: DeepSpeed configs read (transformers' published ZeRO
configs load; unknown and unsupported keys are refused by name), and one DeepSpeed-style
script gives DeepSpeed's fp32 loss curve at stages 1-3 and resumes from its checkpoint."""
import copy
import math

import pytest
import torch

from tests._dist import run_ranks
from zkernels.integrations.deepspeed import KEYS, build_scheduler, read_config

# transformers' docs (main_classes/deepspeed) and tests/deepspeed/ds_config_zero{2,3}.json,
# in their published form.
ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
                                                 "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                            "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8,
                          "overlap_comm": True, "reduce_scatter": True,
                          "reduce_bucket_size": "auto", "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "steps_per_print": 2000, "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
ZERO3 = {
    "fp16": ZERO2["fp16"], "bf16": ZERO2["bf16"], "optimizer": ZERO2["optimizer"],
    "scheduler": ZERO2["scheduler"],
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu",
                                                            "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True},
                          "overlap_comm": True, "contiguous_gradients": True,
                          "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto",
                          "stage3_max_live_parameters": 1e9,
                          "stage3_max_reuse_distance": 1e9,
                          "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "steps_per_print": 2000, "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
# The same without offload (transformers' tests run both).
ZERO2_NO_OFFLOAD = copy.deepcopy(ZERO2)
del ZERO2_NO_OFFLOAD["zero_optimization"]["offload_optimizer"]
ZERO3_NO_OFFLOAD = copy.deepcopy(ZERO3)
for k in ("offload_optimizer", "offload_param"):
    del ZERO3_NO_OFFLOAD["zero_optimization"][k]


class _Args:
    """The TrainingArguments fields HfTrainerDeepSpeedConfig reads."""
    world_size, per_device_train_batch_size, gradient_accumulation_steps = 2, 8, 4
    max_grad_norm, learning_rate, adam_beta1, adam_beta2 = 1.0, 3e-5, 0.9, 0.98
    adam_epsilon, weight_decay = 1e-6, 0.1
    fp16 = fp16_full_eval = bf16_full_eval = False
    bf16 = True

    def get_warmup_steps(self, n):
        return n // 10


class _Model:
    class config:
        hidden_size = 64


@pytest.mark.parametrize("name,cfg", [("zero2", ZERO2), ("zero3", ZERO3),
                                      ("zero2-no-offload", ZERO2_NO_OFFLOAD),
                                      ("zero3-no-offload", ZERO3_NO_OFFLOAD)])
def test_transformers_configs_load(name, cfg):
    zc, ex = read_config(cfg, args=_Args(), model=_Model(), num_training_steps=100,
                         world_size=2)
    stage = cfg["zero_optimization"]["stage"]
    assert zc.stage == stage and zc.precision.param_dtype == torch.bfloat16
    offload = "offload_optimizer" in cfg["zero_optimization"]
    assert zc.offload.kind == ("cpu" if offload else None)
    assert zc.offload.params == (offload and stage == 3)
    if offload:
        assert zc.offload.options.pin_memory is True
    assert zc.buckets.bucket_bytes == (64 * 64 * 4 if stage == 2 else None)
    assert ex["optimizer"] == {"lr": 3e-5, "betas": (0.9, 0.98), "eps": 1e-6,
                               "weight_decay": 0.1, "max_grad_norm": 1.0}
    assert (ex["train_batch_size"], ex["train_micro_batch_size_per_gpu"],
            ex["gradient_accumulation_steps"]) == (64, 8, 4)
    assert ex["scheduler"] == {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 10}}


def test_json_path_and_plain_deepspeed_mappings(tmp_path):
    import json
    cfg = {"train_batch_size": 16, "gradient_accumulation_steps": 2,
           "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                    "loss_scale_window": 500, "hysteresis": 1},
           "communication_data_type": "fp32",
           "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2,
                                 "zero_quantized_weights": True,
                                 "zero_quantized_gradients": True, "mics_shard_size": 4,
                                 "offload_optimizer": {"device": "nvme",
                                                       "nvme_path": str(tmp_path)},
                                 "offload_param": {"device": "nvme",
                                                   "nvme_path": str(tmp_path)}}}
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(cfg))
    zc, ex = read_config(str(p), world_size=4)
    assert zc.precision.param_dtype == torch.float16
    assert zc.precision.reduce_dtype == torch.float32
    assert zc.sharding.reshard_after_forward == 2 and zc.sharding.shard_size == 4
    assert (zc.quantization.weights, zc.quantization.grads) == ("int8", "int4")
    assert (zc.offload.kind, zc.offload.params, zc.offload.dir) == ("nvme", True,
                                                                    str(tmp_path))
    ls = ex["optimizer"]["loss_scale"]
    assert (ls.init_scale, ls.growth_interval) == (2.0 ** 12, 500)
    assert ex["train_micro_batch_size_per_gpu"] == 2


@pytest.mark.parametrize("cfg,key", [
    ({"zero_optimization": {"stage": 2, "stage_two_magic": 1}},
     "zero_optimization.stage_two_magic"),
    ({"zero_optimization": {"stage": 2}, "made_up": 1}, "made_up"),
    ({"zero_optimization": {"stage": 2, "allgather_partitions": False}},
     "zero_optimization.allgather_partitions"),
    ({"zero_optimization": {"stage": 0}}, "zero_optimization.stage"),
    ({"zero_optimization": {"stage": 2}, "fp16": {"enabled": True, "hysteresis": 2}},
     "fp16.hysteresis"),
    ({"zero_optimization": {"stage": 2}, "fp16": {"enabled": True, "loss_scale": 128}},
     "fp16.loss_scale"),
    ({"zero_optimization": {"stage": 2}, "fp16": {"enabled": True, "min_loss_scale": 1}},
     "fp16.min_loss_scale"),
    ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "Lamb", "params": {}}},
     "optimizer.type"),
    ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "Adam", "params": {
        "adam_w_mode": False}}}, "optimizer.params.adam_w_mode"),
    ({"zero_optimization": {"stage": 2}, "scheduler": {"type": "OneCycle", "params": {}}},
     "scheduler.type"),
    ({"zero_optimization": {"stage": 2}, "activation_checkpointing": {}},
     "activation_checkpointing"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     "zero_optimization.offload_param.device"),
    ({"zero_optimization": {"stage": 2}, "tensorboard": {"enabled": True}},
     "tensorboard.enabled"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}},
     "zero_optimization.reduce_bucket_size"),
    ({"zero_optimization": {"stage": 2}, "gradient_clipping": "auto"}, "gradient_clipping"),
])
def test_refused_by_name(cfg, key):
    cfg = dict(cfg, train_micro_batch_size_per_gpu=cfg.get("train_micro_batch_size_per_gpu",
                                                            1))
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        read_config(cfg, world_size=1)


def test_contradicting_training_arguments_refused():
    cfg = copy.deepcopy(ZERO2)
    cfg["optimizer"]["params"]["lr"] = 1e-3
    with pytest.raises(ValueError, match=r"optimizer\.params\.lr"):
        read_config(cfg, args=_Args(), model=_Model(), num_training_steps=100, world_size=2)


def test_explicit_bucket_size_stands_beside_training_arguments():
    cfg = copy.deepcopy(ZERO2_NO_OFFLOAD)
    cfg["zero_optimization"]["reduce_bucket_size"] = 5e7     # transformers' fill_only key
    zc, _ = read_config(cfg, args=_Args(), model=_Model(), num_training_steps=100,
                        world_size=2)
    assert zc.buckets.bucket_bytes == 5 * 10 ** 7 * 4


def test_initialize_one_rank_loader_and_refused_optimizer():
    from zkernels.integrations import deepspeed as ds
    model = torch.nn.Linear(3, 2)
    data = torch.utils.data.TensorDataset(torch.randn(10, 3))
    cfg = {"train_batch_size": 4, "gradient_accumulation_steps": 2,
           "zero_optimization": {"stage": 1},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}
    engine, opt, loader, sched = ds.initialize(model=model, config=cfg, training_data=data)
    assert sched is None and opt.param_groups[0]["lr"] == 0.1
    assert [len(b[0]) for b in loader] == [2, 2, 2, 2, 2]
    assert engine.train_micro_batch_size_per_gpu() == 2
    flags = []
    for (x,) in loader:
        flags.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(x).sum())
        engine.step()
    assert flags == [False, True, False, True, False] and engine.global_steps == 2
    with pytest.raises(ValueError, match="SGD"):
        ds.initialize(model=torch.nn.Linear(3, 2), config=cfg,
                      optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _loader_split(rank, world):
    from zkernels.integrations import deepspeed as ds
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.arange(8.0)[:, None])
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {
        "stage": 2, "mics_shard_size": 1}}          # hybrid: shard groups of one rank
    engine, opt, loader, _ = ds.initialize(model=torch.nn.Linear(1, 1), config=cfg,
                                           training_data=data)
    return opt.comm.world_size, sorted(int(x) for (b,) in loader for x in b.flatten())


def test_initialize_loader_splits_over_the_world_not_the_shard_group():
    # With shard_size=1 each rank's comm holds one rank; the data must still be split in two.
    (g0, seen0), (g1, seen1) = run_ranks(_loader_split, 2, timeout=120)
    assert g0 == g1 == 1
    assert len(seen0) == len(seen1) == 4 and sorted(seen0 + seen1) == list(range(8))


def test_every_key_has_a_disposition():
    assert all(d in ("mapped", "always", "sizing", "refused") and why
               for d, _, why in KEYS.values())


def _ds_lrs(kind, params, steps):
    """DeepSpeed's own scheduler's lrs over ``steps`` steps (lr after construction first)."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime import lr_schedules
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    sched = getattr(lr_schedules, kind)(opt, **params)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(steps):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


@pytest.mark.parametrize("kind,params", [
    ("WarmupLR", {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 5}),
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4,
                  "warmup_type": "linear"}),
    ("WarmupDecayLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4,
                       "total_num_steps": 12}),
    ("WarmupCosineLR", {"warmup_min_ratio": 0.1, "warmup_num_steps": 4,
                        "total_num_steps": 12, "cos_min_ratio": 0.01,
                        "warmup_type": "linear"}),
])
def test_schedulers_match_deepspeed(kind, params, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    want = _ds_lrs(kind, params, 15)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    sched = build_scheduler(opt, {"type": kind, "params": params})
    got = [opt.param_groups[0]["lr"]]
    for _ in range(15):
        opt.step()        # (no gradients: nothing moves) torch's order, so it does not warn
        sched.step()
        got.append(opt.param_groups[0]["lr"])
    assert all(math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15) for a, b in zip(got, want)), \
        (got, want)


RUNS = [(1, 1), (2, 2), (3, 1)]


def test_script_matches_deepspeed_and_resumes(tmp_path):
    pytest.importorskip("deepspeed")   # the reference; not a zkernels dependency
    from tests.integrations._ds_script import train
    ours = run_ranks(train, 2, "zkernels", RUNS, str(tmp_path), timeout=600)
    theirs = run_ranks(train, 2, "deepspeed", RUNS, str(tmp_path), timeout=600,
                       check_teardown=False)   # DeepSpeed's groups, not ours: see run_ranks
    for rank in range(2):
        for run in RUNS:
            o, d = ours[rank][run], theirs[rank][run]
            assert [b for *_, b in o["full"]] == [b for *_, b in d["full"]] == \
                [(i + 1) % run[1] == 0 for i in range(6 * run[1])], run
            flat = [v for loss, scaled, _ in o["full"] for v in (loss, scaled)]
            want = [v for loss, scaled, _ in d["full"] for v in (loss, scaled)]
            assert flat == pytest.approx(want, rel=1e-5, abs=1e-7), run
            assert o["full"][0][1] == pytest.approx(o["full"][0][0] / run[1], rel=1e-6)
            assert o["lr"] == pytest.approx(d["lr"], rel=1e-12), run
            assert o["steps"] == d["steps"] == 6 and o["loaded_steps"] == 3
            assert o["latest"] == d["latest"] == "global_step3"
            assert o["client"]["micro"] == 3 * run[1] - 1
            half = len(o["full"]) // 2
            assert [r[0] for r in o["resumed"]] == pytest.approx(
                [r[0] for r in o["full"][half:]], rel=1e-6, abs=1e-8), run
            assert o["lr_resumed"] == pytest.approx(o["lr"], rel=1e-12)
