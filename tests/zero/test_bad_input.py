"""Bad input gets an exception naming the problem (world size 1, no process group)."""
import pytest
import torch
import torch.nn as nn

import zkernels as zk
from zkernels.zero import ZeroOptimizer, resolve_stage
from zkernels.zero.planning.offload_config import OffloadConfig
from tests.zero._harness import CFG, make_model


def test_no_trainable_parameters():
    model = nn.Linear(3, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        ZeroOptimizer(model)


def test_parameters_on_different_devices():
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match="several devices"):
        ZeroOptimizer(model)


def test_parameters_on_meta_only():
    with pytest.raises(ValueError, match="meta"):
        ZeroOptimizer(nn.Linear(3, 2, device="meta"))


def test_param_group_with_a_foreign_tensor():
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\] is not a parameter"):
        ZeroOptimizer(model, param_groups=[{"params": [model.weight, model.bias]},
                                           {"params": [torch.zeros(3, requires_grad=True)]}])


def test_param_groups_must_cover_and_not_repeat():
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="leaves out trainable parameters"):
        ZeroOptimizer(model, param_groups=[{"params": [model.weight]}])
    with pytest.raises(ValueError, match="appears in param_groups"):
        ZeroOptimizer(model, param_groups=[{"params": [model.weight, model.bias]},
                                           {"params": [model.bias]}])


@pytest.mark.parametrize("stage", [0, 4, "Auto", "1", True, None])
def test_unknown_stage(stage):
    with pytest.raises(ValueError, match="stage"):
        ZeroOptimizer(nn.Linear(3, 2), stage=stage)
    with pytest.raises(ValueError, match="stage"):
        resolve_stage(stage)


def test_bucket_too_small_for_one_element_per_rank():
    # fp32 reduce, 16-byte alignment: a bucket needs 4 elements (16 bytes) per rank.
    with pytest.raises(ValueError, match="bucket_bytes=8 is too small"):
        ZeroOptimizer(nn.Linear(3, 2), bucket_bytes=8)
    ZeroOptimizer(nn.Linear(3, 2), bucket_bytes=16)  # the minimum works: one param a bucket


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"offload": "cpu"}, ValueError, "offload='cpu' needs stage 2"),   # the default stage 1
    ({"offload": "nvme", "offload_dir": "/tmp"}, ValueError, "offload='nvme' needs stage 2"),
    ({"offload": "disk", "stage": 2}, ValueError, "offload must be None, 'cpu' or 'nvme'"),
    ({"offload_dir": "/tmp"}, ValueError, "offload_dir applies only to offload='nvme'"),
    ({"offload": "cpu", "stage": 2, "offload_dir": "/tmp"}, ValueError, "offload_dir applies"),
    ({"offload": "nvme", "stage": 2}, ValueError, "needs offload_dir="),
    ({"offload": "nvme", "stage": 2, "offload_dir": "/no/such/dir"}, ValueError,
     "offload_dir='/no/such/dir' is not an existing folder"),
    ({"offload_config": OffloadConfig()}, ValueError, "offload_config applies only"),
    ({"offload": "cpu", "stage": 2, "offload_config": {"pin_memory": False}}, TypeError,
     "offload_config must be"),
    ({"offload": "cpu", "stage": 2, "offload_config": OffloadConfig(resume_dir="/tmp")},
     ValueError, "resume_dir applies only to offload='nvme'")])
def test_bad_offload_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ZeroOptimizer(nn.Linear(3, 2), **kwargs)


@pytest.mark.parametrize("field, value", [("sub_group_numel", 0), ("nvme_buffer_bytes", -1),
                                          ("io_threads", 1.5), ("pin_memory", "yes"),
                                          ("nvme_master", None), ("direct_io", 1)])
def test_bad_offload_config(field, value):
    with pytest.raises(ValueError, match=f"OffloadConfig.{field}"):
        OffloadConfig(**{field: value})


@pytest.mark.parametrize("kwargs, name", [
    ({"param_dtype": torch.int8}, "param_dtype"), ({"reduce_dtype": torch.float64}, "reduce_dtype"),
    ({"lr": -1.0}, "lr"), ({"betas": (0.9, 1.0)}, "betas"), ({"eps": -1.0}, "eps"),
    ({"weight_decay": -0.1}, "weight_decay"), ({"max_grad_norm": 0.0}, "max_grad_norm"),
    ({"loss_scale": zk.zero.LossScaleConfig()}, "loss_scale"),
    ({"process_group": object()}, "process_group")])
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ZeroOptimizer(nn.Linear(3, 2), **kwargs)


def test_group_hyperparameters_are_checked():
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"param_groups\[1\]: lr"):
        ZeroOptimizer(model, param_groups=[{"params": [model.weight]},
                                           {"params": [model.bias], "lr": -1.0}])


def test_non_fp32_parameters():
    with pytest.raises(ValueError, match="dtype torch.bfloat16"):
        ZeroOptimizer(nn.Linear(3, 2).to(torch.bfloat16))


def test_fp16_needs_scaled_backward():
    model = make_model()
    opt = ZeroOptimizer(model, param_dtype=torch.float16)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.block_size))
    model(x, x).backward()
    with pytest.raises(RuntimeError, match=r"opt.backward\(loss\)"):
        opt.step()


def test_param_groups_cannot_be_added_later():
    model = nn.Linear(3, 2)
    opt = ZeroOptimizer(model, param_groups=[{"params": [model.weight]},
                                             {"params": [model.bias], "weight_decay": 0.0}])
    with pytest.raises(RuntimeError, match="constructor"):
        opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})


def test_state_dict_of_another_layout():
    opt1 = ZeroOptimizer(nn.Linear(3, 2))
    opt2 = ZeroOptimizer(nn.Linear(4, 2))
    with pytest.raises(ValueError, match="bucket layout"):
        opt2.load_state_dict(opt1.state_dict())
    with pytest.raises(ValueError, match="state_dict"):
        opt2.load_state_dict({"state": {}})
