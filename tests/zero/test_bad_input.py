"""Bad input across the public API, one table: each case must raise an exception whose message
names the argument and says what was expected (never a hang, a traceback from deep inside, or
a silent wrong answer). One row per case, at world size 1 without a process group; the CLI
cases check the exit status and stderr.

Other modules test some of these in more depth (tests/test_cli.py,
tests/native/test_binding_errors.py); this one lists them side by side, one line each, so a gap
is visible. plan's --device-memory/--params/output paths and bench --ops are tested with their
fixes elsewhere.
"""
import contextlib
import io

import pytest
import torch
import torch.nn as nn

import zkernels as zk
from tests.zero._harness import CFG, make_model
from zkernels import ops
from zkernels.zero import LossScaleConfig, ZeroOptimizer, resolve_stage
from zkernels.zero.planning.offload_config import OffloadConfig


class CliError(Exception):
    """A CLI entry point returned non-zero; the message is its stderr."""


def _cli(main, argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse's own errors
            rc = exc.code
    if rc not in (0, None):
        raise CliError(err.getvalue())


def plan(*argv):
    from zkernels.plan import main
    return lambda: _cli(main, list(argv))


def demo(*argv):
    from zkernels.demo.launch import main
    return lambda: _cli(main, list(argv))


def lin():
    return nn.Linear(3, 2)


def zero(**kw):
    return lambda: ZeroOptimizer(lin(), **kw)


def _foreign_state_dict():
    ZeroOptimizer(lin()).load_state_dict(torch.optim.AdamW(lin().parameters()).state_dict())


def _other_world_size():
    model = lin()
    opt = ZeroOptimizer(model)
    sd = opt.state_dict()
    sd["zero"]["world_size"] = 2
    opt.load_state_dict(sd)


def _fp16_step_without_scaled_backward():
    model = make_model()
    opt = ZeroOptimizer(model, param_dtype=torch.float16)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.block_size))
    model(x, x).backward()
    opt.step()


def _add_param_group_later():
    model = lin()
    opt = ZeroOptimizer(model, param_groups=[{"params": [model.weight]},
                                             {"params": [model.bias], "weight_decay": 0.0}])
    opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})


def _load_state_of_another_layout(state=None):
    sd = ZeroOptimizer(lin()).state_dict() if state is None else state
    ZeroOptimizer(nn.Linear(4, 2)).load_state_dict(sd)


def _group(groups):
    model = lin()
    return ZeroOptimizer(model, param_groups=groups(model))


ADAM = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
Z3 = torch.zeros(3)

# (id, thunk, exception type, regex on the message: the argument and what was expected)
CASES = [
    # constructor arguments
    ("model_not_a_module", lambda: ZeroOptimizer([torch.zeros(2)]), TypeError,
     r"model must be a torch.nn.Module, got list"),
    ("stage_unknown", zero(stage=4), ValueError, r"stage must be one of \(1, 2.*got 4"),
    ("lr_negative", zero(lr=-1.0), ValueError, r"lr must be >= 0, got -1"),
    ("lr_not_a_number", zero(lr="fast"), TypeError, r"lr must be a number, got 'fast'"),
    ("betas_not_a_pair", zero(betas=(0.9,)), ValueError, r"betas must be a pair in \[0, 1\)"),
    ("eps_negative", zero(eps=-1e-8), ValueError, r"eps must be >= 0"),
    ("bucket_bytes_float", zero(bucket_bytes=1.5e6), TypeError,
     r"bucket_bytes must be an int, got float"),
    ("bucket_bytes_too_small", zero(bucket_bytes=8), ValueError,
     r"bucket_bytes=8 is too small: a bucket must hold at least"),
    ("max_grad_norm_zero", zero(max_grad_norm=0.0), ValueError,
     r"max_grad_norm must be > 0 or None, got 0"),
    ("param_dtype_int", zero(param_dtype=torch.int8), ValueError,
     r"param_dtype must be None, torch.float32, torch.bfloat16 or torch.float16, got torch.int8"),
    ("reduce_dtype_fp64", zero(reduce_dtype=torch.float64), ValueError,
     r"reduce_dtype must be None, .*got torch.float64"),
    ("loss_scale_without_fp16", zero(loss_scale=LossScaleConfig()), ValueError,
     r"loss_scale applies only to param_dtype=torch.float16"),
    ("loss_scale_not_a_config", zero(param_dtype=torch.float16, loss_scale=1024.0), TypeError,
     r"loss_scale must be a LossScaleConfig or None, got float"),
    ("comm_backend_unknown", zero(comm_backend="mpi"), ValueError,
     r"comm_backend must be one of \('auto', 'torch', 'nccl'\), got 'mpi'"),
    ("nonfinite_unknown", zero(nonfinite="ignore"), ValueError,
     r"nonfinite must be one of \('skip', 'raise'\), got 'ignore'"),
    ("memory_budget_without_auto", zero(memory_budget_bytes=10), ValueError,
     r"memory_budget_bytes applies only to stage='auto', got stage=1"),
    ("memory_budget_negative", zero(stage="auto", memory_budget_bytes=-5), ValueError,
     r"memory_budget_bytes must be a positive int, got -5"),
    ("process_group_without_init", zero(process_group=object()), ValueError,
     r"process_group was given but torch.distributed is not initialized"),
    # param_groups
    ("param_groups_not_a_list", zero(param_groups={"params": []}), TypeError,
     r"param_groups must be a list of dicts, got dict"),
    ("param_groups_entry_without_params", zero(param_groups=[{"lr": 1.0}]), TypeError,
     r"param_groups\[0\] must be a dict with a 'params' list"),
    ("param_groups_foreign_tensor",
     lambda: _group(lambda m: [{"params": list(m.parameters())},
                               {"params": [torch.zeros(3, requires_grad=True)]}]),
     ValueError, r"param_groups\[1\]\['params'\]\[0\] is not a parameter of model"),
    ("param_groups_leave_out_a_parameter", lambda: _group(lambda m: [{"params": [m.weight]}]),
     ValueError, r"param_groups leaves out trainable parameters"),
    ("param_groups_bad_lr",
     lambda: _group(lambda m: [{"params": [m.weight]}, {"params": [m.bias], "lr": -2.0}]),
     ValueError, r"param_groups\[1\]: lr must be >= 0, got -2"),
    # offload / offload_dir
    ("offload_unknown", zero(offload="tape"), ValueError,
     r"offload must be None, 'cpu' or 'nvme', got 'tape'"),
    ("offload_dir_without_nvme", zero(offload_dir="/tmp"), ValueError,
     r"offload_dir applies only to offload='nvme' \(got offload=None, offload_dir='/tmp'\)"),
    ("offload_params_at_stage_2", zero(stage=2, offload="cpu", offload_params=True), ValueError,
     r"offload_params=True applies only to stage=3, got stage=2"),
    ("units_not_a_list", zero(stage=3, units="blocks"), TypeError,
     r"units must be None or a list of nn.Module classes or modules of the model, got str"),
    ("units_entry_not_a_module", zero(stage=3, units=[42]), TypeError,
     r"units\[0\] must be an nn.Module class or a module of the model, got int"),
    ("offload_params_without_offload", zero(stage=3, offload_params=True), ValueError,
     r"offload_params=True needs offload='cpu' or 'nvme'"),
    ("offload_params_not_bool", zero(stage=3, offload="cpu", offload_params=1), TypeError,
     r"offload_params must be a bool, got int"),
    # hybrid sharding and secondary shards (issue 16)
    ("shard_size_not_a_divisor", zero(stage=2, shard_size=2), ValueError,
     r"shard_size=2 must divide the number of ranks \(1\)"),
    ("shard_size_not_int", zero(stage=2, shard_size=1.5), TypeError,
     r"shard_size must be an int \(ranks per shard group\) or None, got float"),
    ("mesh_not_a_device_mesh", zero(stage=2, mesh=[[0, 1]]), TypeError,
     r"mesh must be a torch.distributed.device_mesh.DeviceMesh, got list"),
    ("reshard_after_forward_int_at_stage_2", zero(stage=2, reshard_after_forward=2), ValueError,
     r"reshard_after_forward=2 applies only to stage=3"),
    ("estimate_shard_size_not_a_divisor",
     lambda: zk.estimate_memory(1000, world_size=8, stage=2, shard_size=3), ValueError,
     r"shard_size=3 must divide the number of ranks \(8\)"),
    ("plan_shard_size_not_a_divisor", plan("--params", "1e9", "--world-size", "8",
                                           "--shard-size", "3"), CliError,
     r"--shard-size must divide --world-size \(8\), got 3"),
    # load_state_dict
    ("load_state_dict_foreign", _foreign_state_dict, ValueError,
     r"state_dict must be a dict from ZeroOptimizer.state_dict\(\) with keys"),
    ("load_state_dict_other_world_size", _other_world_size, ValueError, r"world size"),
    # ops: dtypes, devices, shapes
    ("flatten_int_dtype", lambda: ops.flatten([torch.zeros(3, dtype=torch.int32)]), TypeError,
     r"tensors\[0\] must have dtype in \(torch.float32, torch.bfloat16, torch.float16\), "
     r"got torch.int32"),
    ("flatten_mixed_devices", lambda: ops.flatten([Z3, torch.zeros(3, device="meta")]),
     ValueError, r"tensors\[1\] is on meta but tensors\[0\] is on cpu"),
    ("unflatten_flat_too_small", lambda: ops.unflatten(torch.zeros(5), [(2, 3)]), ValueError,
     r"flat is too small: tensor 0 needs elements \[0, 6\) but it has 5"),
    ("cast_to_int", lambda: ops.cast(Z3, torch.int8), TypeError,
     r"dtype must be one of \(torch.float32, torch.bfloat16, torch.float16\), got torch.int8"),
    ("adamw_grad_shape", lambda: ops.adamw_step(Z3.clone(), torch.zeros(4), Z3.clone(),
                                                Z3.clone(), step=1, **ADAM),
     ValueError, r"grad must have 3 elements, got 4"),
    ("adamw_fp16_param", lambda: ops.adamw_step(torch.zeros(3, dtype=torch.float16), Z3,
                                                Z3.clone(), Z3.clone(), step=1, **ADAM),
     TypeError, r"param must have dtype in \(torch.float32\), got torch.float16"),
    ("adamw_step_zero", lambda: ops.adamw_step(Z3.clone(), Z3, Z3.clone(), Z3.clone(), step=0,
                                               **ADAM),
     ValueError, r"step must be >= 1"),
    ("bucket_pack_not_contiguous",
     lambda: ops.bucket_pack([torch.zeros(3, 3).t()], torch.zeros(20), [0]), ValueError,
     r"tensors\[0\] must be contiguous"),
    ("sum_squares_int", lambda: ops.sum_squares([torch.zeros(3, dtype=torch.int64)]),
     TypeError, r"tensors\[0\] must have dtype in"),
    ("quantize_bits", lambda: ops.quantize(Z3, bits=2), ValueError,
     r"bits must be 8 or 4, got 2"),
    ("quantize_block_size", lambda: ops.quantize(Z3, block_size=100), ValueError,
     r"block_size must be a power of two in \[2, 8192\], got 100"),
    ("dequantize_int4_codes_int8", lambda: ops.dequantize(torch.zeros(2, dtype=torch.int8),
                                                          torch.zeros(1), bits=4), TypeError,
     r"q must have dtype in \(torch.uint8\)"),
    ("dequantize_sum_scales_shape",
     lambda: ops.dequantize_sum(torch.zeros(2, 3, dtype=torch.int8), torch.zeros(3, 1), Z3),
     ValueError, r"scales must have shape \(2, 1\)"),
    # estimator
    ("estimate_world_size_zero", lambda: zk.estimate_memory(1000, world_size=0, stage=1),
     ValueError, r"world_size must be an int >= 1, got 0"),
    ("estimate_stage_unknown", lambda: zk.estimate_memory(1000, world_size=2, stage=7),
     ValueError, r"stage must be one of \(1, 2, 3\) or 'auto' \(0: data parallel, the "
     r"estimator's baseline\), got 7"),
    # CLI: plan and demo (demo's checks run before any rank starts)
    ("plan_world_size_zero", plan("--params", "1e9", "--world-size", "0"), CliError,
     r"--world-size: must be >= 1, got 0"),
    ("plan_param_dtype_unknown", plan("--params", "1e9", "--world-size", "2",
                                      "--param-dtype", "int4"), CliError,
     r"--param-dtype must be .*got 'int4'"),
    ("demo_nproc_zero", demo("--nproc", "0"), CliError, r"--nproc must be >= 1, got 0"),
    ("demo_steps_zero", demo("--steps", "0"), CliError, r"--steps must be >= 1, got 0"),
    ("demo_batch_size_zero", demo("--batch-size", "0"), CliError,
     r"--batch-size must be >= 1, got 0"),
    ("demo_bucket_bytes_zero", demo("--bucket-bytes", "0"), CliError,
     r"--bucket-bytes must be >= 1, got 0"),
    ("demo_n_embd_not_multiple_of_heads", demo("--n-embd", "65", "--n-head", "2"), CliError,
     r"--n-embd must be a multiple of --n-head, got --n-embd 65 and --n-head 2"),
    ("demo_rungs_unknown", demo("--rungs", "ddp,5"), CliError,
     r"--rungs: unknown rung '5' in 'ddp,5'; valid .* 3\+cpu\+params \(stage 3 \+ cpu offload "
     r"\+ params on host\)"),
    ("demo_rungs_twice", demo("--rungs", "2,stage 2"), CliError,
     r"--rungs lists stage 2 twice"),
    ("demo_lr_negative", demo("--lr", "-1"), CliError, r"--lr must be >= 0, got -1"),
    ("model_without_trainable_parameters", lambda: ZeroOptimizer(lin().requires_grad_(False)),
     ValueError, r"no trainable parameters"),
    ("parameters_on_different_devices",
     lambda: ZeroOptimizer(nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2, device="meta"))),
     ValueError, r"several devices"),
    ("parameters_on_meta_only", lambda: ZeroOptimizer(nn.Linear(3, 2, device="meta")),
     ValueError, r"meta"),
    ("parameters_mixed_dtypes",
     lambda: ZeroOptimizer(nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2).bfloat16())),
     ValueError, r"several dtypes: '0.weight' is torch.float32 but '1.weight' is "
                 r"torch.bfloat16.*param_dtype"),
    ("parameters_fp64", lambda: ZeroOptimizer(lin().double()), ValueError,
     r"has dtype torch.float64; ZeroOptimizer takes float32, bfloat16 or float16"),
    *[(f"stage_{s}", zero(stage=s), ValueError, r"stage") for s in (0, 4, "Auto", "1", True,
                                                                        None)],
    *[(f"resolve_stage_{s}", lambda s=s: resolve_stage(s), ValueError, r"stage")
      for s in (0, 4, "Auto", "1", True, None)],
    ("betas_second_one", zero(betas=(0.9, 1.0)), ValueError, r"betas"),
    ("eps_minus_one", zero(eps=-1.0), ValueError, r"eps"),
    ("weight_decay_negative", zero(weight_decay=-0.1), ValueError, r"weight_decay"),
    ("param_groups_repeat_a_parameter",
     lambda: _group(lambda m: [{"params": [m.weight, m.bias]}, {"params": [m.bias]}]),
     ValueError, r"appears in param_groups"),
    ("add_param_group_after_construction", _add_param_group_later, RuntimeError,
     r"constructor"),
    ("fp16_step_without_scaled_backward", _fp16_step_without_scaled_backward, RuntimeError,
     r"opt.backward\(loss\)"),
    ("load_state_dict_of_another_layout", _load_state_of_another_layout, ValueError,
     r"bucket layout"),
    ("load_state_dict_without_zero_keys", lambda: _load_state_of_another_layout({"state": {}}),
     ValueError, r"state_dict"),
    # offload arguments and OffloadConfig
    ("offload_cpu_at_stage_1", zero(offload="cpu"), ValueError,
     r"offload='cpu' needs stage 2"),
    ("offload_nvme_at_stage_1", zero(offload="nvme", offload_dir="/tmp"), ValueError,
     r"offload='nvme' needs stage 2"),
    ("offload_unknown_at_stage_2", zero(offload="disk", stage=2), ValueError,
     r"offload must be None, 'cpu' or 'nvme'"),
    ("offload_dir_with_cpu", zero(offload="cpu", stage=2, offload_dir="/tmp"), ValueError,
     r"offload_dir applies"),
    ("offload_nvme_without_dir", zero(offload="nvme", stage=2), ValueError,
     r"needs offload_dir="),
    ("offload_dir_missing", zero(offload="nvme", stage=2, offload_dir="/no/such/dir"),
     ValueError, r"offload_dir='/no/such/dir' is not an existing folder"),
    ("offload_config_without_offload", zero(offload_config=OffloadConfig()), ValueError,
     r"offload_config applies only"),
    ("offload_config_a_dict", zero(offload="cpu", stage=2, offload_config={"pin_memory": False}),
     TypeError, r"offload_config must be"),
    ("offload_config_resume_dir_with_cpu",
     zero(offload="cpu", stage=2, offload_config=OffloadConfig(resume_dir="/tmp")), ValueError,
     r"resume_dir applies only to offload='nvme'"),
    *[(f"offload_config_{field}_{value}", lambda f=field, v=value: OffloadConfig(**{f: v}),
       ValueError, rf"OffloadConfig.{field}")
      for field, value in [("sub_group_numel", 0), ("nvme_buffer_bytes", -1),
                           ("io_threads", 1.5), ("pin_memory", "yes"), ("nvme_master", None),
                           ("direct_io", 1)]],
]


def test_catalog_is_large_and_distinct():
    ids = [c[0] for c in CASES]
    assert len(ids) >= 20 and len(set(ids)) == len(ids)


@pytest.mark.parametrize("thunk, exc, match", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(thunk, exc, match):
    with pytest.raises(exc, match=match):
        thunk()


def test_the_smallest_bucket_works():
    """fp32 reduce, 16-byte alignment: a bucket needs 4 elements (16 bytes) per rank, and that
    minimum works (``bucket_bytes_too_small`` refuses 8)."""
    ZeroOptimizer(lin(), bucket_bytes=16)
