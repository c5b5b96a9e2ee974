"""Compile every Triton kernel for sm_90 and report, as JSON on stdout, per case: whether it
compiled and whether its PTX has 128-bit global accesses. Run in a process without
TRITON_INTERPRET (``triton.jit`` decides between interpreter and compiler when it decorates):
``python -m tests.ops._compile_sm90``.
"""
import json
import re
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from zkernels.kernels._copy import _scaled_copy_kernel
from zkernels.kernels.adamw import _adamw_step_kernel, _sum_squares_kernel
from zkernels.kernels.adamw_lowbit import _adamw_lowbit_kernel
from zkernels.kernels.cast import _cast_kernel, _unscale_and_check_kernel
from zkernels.kernels import ademamix, lion, sgd
from zkernels.kernels.optimizer import _optimizer_step_kernel
from zkernels.kernels.quant import _dequantize_kernel, _quantize_kernel

TABLE_SIG = {"meta": "*i64", "num_tensors": "i32", "num_blocks": "i32"}
ADAMW_SCALARS = ("lr", "grad_scale", "decay", "weight_decay", "one_minus_beta1", "beta2",
                 "one_minus_beta2", "beta1_hi", "beta1_lo", "beta2_hi", "beta2_lo", "step_size",
                 "bias_correction2_sqrt", "eps")
ADAMW_SIG = {"param_ptr": "*fp32", "grad_ptr": "*bf16", "exp_avg_ptr": "*fp32",
             "exp_avg_sq_ptr": "*fp32", "out_ptr": "*bf16", "found_inf_ptr": "*fp32",
             "grad_scale_ptr": "*fp32", "step_ptr": "*fp32", "numel": "i32",
             **{k: "fp32" for k in ADAMW_SCALARS}}
ADAMW_ALL = dict(GRAD_SCALE=True, GRAD_SCALE_IS_TENSOR=True, STEP_IS_TENSOR=True,
                 HAS_FOUND_INF=True, DECOUPLED=True, HAS_WD=True, LERP_SMALL_WEIGHT=True,
                 HAS_OUT=True, NATIVE_NAN=True, BLOCK=2048)
ADAMW_NONE = dict(ADAMW_ALL, GRAD_SCALE=False, GRAD_SCALE_IS_TENSOR=False, STEP_IS_TENSOR=False,
                  HAS_FOUND_INF=False, DECOUPLED=False, LERP_SMALL_WEIGHT=False, HAS_OUT=False)

# (kernel, runtime signature, constexprs, expect 128-bit accesses); pointer arguments are
# declared 16-byte aligned, as Triton specializes them for tensors from the caching allocator.
CASES = {
    "copy_f32_bf16_scaled": (_scaled_copy_kernel, {**TABLE_SIG, "scale": "fp32"},
                             dict(SRC=tl.float32, DST=tl.bfloat16, HAS_SCALE=True,
                                  FP32_ROUTE=True, NATIVE_NAN=True, BLOCK=4096), True),
    "copy_f32_f16_scaled": (_scaled_copy_kernel, {**TABLE_SIG, "scale": "fp32"},
                            dict(SRC=tl.float32, DST=tl.float16, HAS_SCALE=True,
                                 FP32_ROUTE=True, NATIVE_NAN=True, BLOCK=4096), True),
    "copy_f32_f32": (_scaled_copy_kernel, {**TABLE_SIG, "scale": "fp32"},
                     dict(SRC=tl.float32, DST=tl.float32, HAS_SCALE=False, FP32_ROUTE=False,
                          NATIVE_NAN=True, BLOCK=4096), True),
    "copy_f16_bf16": (_scaled_copy_kernel, {**TABLE_SIG, "scale": "fp32"},
                      dict(SRC=tl.float16, DST=tl.bfloat16, HAS_SCALE=False, FP32_ROUTE=False,
                           NATIVE_NAN=True, BLOCK=4096), True),
    "cast_f32_f16": (_cast_kernel, {"x_ptr": "*fp32", "out_ptr": "*fp16", "numel": "i32"},
                     dict(NATIVE_NAN=True, BLOCK=4096), True),
    "cast_bf16_f32": (_cast_kernel, {"x_ptr": "*bf16", "out_ptr": "*fp32", "numel": "i32"},
                      dict(NATIVE_NAN=True, BLOCK=4096), True),
    "unscale_bf16": (_unscale_and_check_kernel,
                     {"x_ptr": "*bf16", "inv_scale": "fp32", "inv_ptr": "*fp32",
                      "found_inf_ptr": "*fp32", "numel": "i32"},
                     dict(INV_IS_TENSOR=True, NATIVE_NAN=True, BLOCK=4096), True),
    "adamw_all_options": (_adamw_step_kernel, ADAMW_SIG, ADAMW_ALL, True),
    "adamw_no_options": (_adamw_step_kernel, ADAMW_SIG, ADAMW_NONE, True),
    "sum_squares_bf16": (_sum_squares_kernel, {**TABLE_SIG, "partials_ptr": "*fp32"},
                         dict(SRC=tl.bfloat16, MIXED=False, BLOCK=4096), True),
    "sum_squares_mixed": (_sum_squares_kernel, {**TABLE_SIG, "partials_ptr": "*fp32"},
                          dict(SRC=tl.float32, MIXED=True, BLOCK=4096), False),
}

QUANT_SIG = {"x_ptr": "*fp32", "q_ptr": "*i8", "scales_ptr": "*fp32", "numel": "i32",
             "num_blocks": "i32"}
DEQUANT_SIG = {"q_ptr": "*i8", "scales_ptr": "*fp32", "out_ptr": "*bf16", "numel": "i32",
               "num_blocks": "i32", "q_row": "i32", "s_row": "i32", "scale": "fp32"}
DEQUANT_ALL = dict(NUM_CHUNKS=8, SUM=True, ACCUMULATE=True, BITS=8, BLOCK=256, ROWS=16,
                   NATIVE_NAN=True)
# The quantization kernels launch with enable_fp_fusion=False (zkernels/kernels/quant.py):
# compiled the same way, their PTX must hold no fma, or a product and a sum rounded once.
NO_FMA = {
    "quantize_int8_f32": (_quantize_kernel, QUANT_SIG,
                          dict(BITS=8, QMAX=127, BLOCK=256, ROWS=16), False),
    "quantize_int4_bf16": (_quantize_kernel, {**QUANT_SIG, "x_ptr": "*bf16", "q_ptr": "*u8"},
                           dict(BITS=4, QMAX=7, BLOCK=64, ROWS=64), False),
    "dequantize_sum_int8_bf16": (_dequantize_kernel, DEQUANT_SIG, DEQUANT_ALL, False),
    "dequantize_sum_int4_f32": (_dequantize_kernel,
                                {**DEQUANT_SIG, "q_ptr": "*u8", "out_ptr": "*fp32"},
                                dict(DEQUANT_ALL, BITS=4, BLOCK=8192, ROWS=1), False),
    "dequantize_int8_f16": (_dequantize_kernel, {**DEQUANT_SIG, "out_ptr": "*fp16"},
                            dict(DEQUANT_ALL, NUM_CHUNKS=1, SUM=False, ACCUMULATE=False),
                            False),
}
# The generic optimizer kernel (Lion, SGD, AdEMAMix bodies) launches the same way
# (bit-exact with the reference on a GPU too).
OPT_SIG = {"param_ptr": "*fp32", "grad_ptr": "*bf16", "s0_ptr": "*fp32", "s1_ptr": "*fp32",
           "s2_ptr": "*fp32", "out_ptr": "*bf16", "found_inf_ptr": "*fp32",
           "grad_scale_ptr": "*fp32", "numel": "i32", "grad_scale": "fp32",
           **{f"c{i}": "fp32" for i in range(12)}}
OPT_ALL = dict(HAS_S0=True, HAS_S1=True, HAS_S2=True, GRAD_SCALE=True,
               GRAD_SCALE_IS_TENSOR=True, HAS_FOUND_INF=True, HAS_OUT=True, NATIVE_NAN=True,
               BLOCK=2048)
OPT_NONE = dict(OPT_ALL, GRAD_SCALE=False, GRAD_SCALE_IS_TENSOR=False, HAS_FOUND_INF=False,
                HAS_OUT=False)
ONE_STATE = dict(HAS_S1=False, HAS_S2=False)
LOWBIT_SIG = {**ADAMW_SIG, "param_ptr": "*bf16", "m_ptr": "*bf16", "v_ptr": "*bf16",
              "ms_ptr": "*fp32", "vs_ptr": "*fp32", "num_blocks": "i32"}
LOWBIT_ALL = dict(ADAMW_ALL, INT8=False, BLOCK=256, ROWS=8)
NO_FMA.update({
    "ademamix_all_options": (_optimizer_step_kernel, OPT_SIG,
                             dict(OPT_ALL, BODY=ademamix.BODY), True),
    "ademamix_bf16_state_bf16_param": (_optimizer_step_kernel,
                                       {**OPT_SIG, "param_ptr": "*bf16", "s0_ptr": "*bf16",
                                        "s1_ptr": "*bf16", "s2_ptr": "*bf16"},
                                       dict(OPT_NONE, BODY=ademamix.BODY), True),
    "lion_all_options": (_optimizer_step_kernel, OPT_SIG,
                         dict(OPT_ALL, BODY=lion.BODY, **ONE_STATE), True),
    "lion_no_options": (_optimizer_step_kernel, {**OPT_SIG, "grad_ptr": "*fp32"},
                        dict(OPT_NONE, BODY=lion.BODY, **ONE_STATE), True),
    "sgd_all_options": (_optimizer_step_kernel, OPT_SIG,
                        dict(OPT_ALL, BODY=sgd.BODY, **ONE_STATE), True),
    "adamw_lowbit_bf16_all_options": (_adamw_lowbit_kernel, LOWBIT_SIG, LOWBIT_ALL, False),
    "adamw_lowbit_int8": (_adamw_lowbit_kernel,
                          {**LOWBIT_SIG, "param_ptr": "*fp32", "m_ptr": "*i8", "v_ptr": "*u8"},
                          dict(LOWBIT_ALL, INT8=True), False),
    "sgd_no_momentum": (_optimizer_step_kernel, {**OPT_SIG, "grad_ptr": "*fp32"},
                        dict(OPT_NONE, BODY=sgd.BODY, HAS_S0=False, **ONE_STATE), True),
})
CASES.update(NO_FMA)


def compile_case(name):
    fn, runtime_sig, constexprs, _ = CASES[name]
    names = list(fn.arg_names)
    missing = [n for n in names if n not in runtime_sig and n not in constexprs]
    if missing:
        return {"ok": False, "error": f"case signature lacks {missing}"}
    signature = {n: runtime_sig.get(n, "constexpr") for n in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if runtime_sig.get(n, "").startswith("*")}
    options = {"enable_fp_fusion": False} if name in NO_FMA else None
    try:
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                                            attrs=aligned), target=GPUTarget("cuda", 90, 32),
                                  options=options)
    except Exception as exc:  # reported, and the test fails on it
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    ptx = compiled.asm["ptx"]
    return {"ok": ".entry" in ptx and bool(compiled.asm.get("cubin")),
            "wide": bool(re.search(r"(ld|st)\.global(\.\w+)*\.v4\.b32", ptx)),
            "fma": bool(re.search(r"\bfma\.rn(\.ftz)?\.f32", ptx)),
            "approx_div": bool(re.search(r"\bdiv\.(approx|full)", ptx))}


if __name__ == "__main__":
    json.dump({name: compile_case(name) for name in (sys.argv[1:] or CASES)}, sys.stdout)
