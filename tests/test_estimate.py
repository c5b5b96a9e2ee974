"""The memory estimator against the ZeRO paper's worked example and docs/design.md#the-ladder, and
``choose_rung``'s decisions (pure arithmetic: no ranks needed)."""
import pytest
import torch

from zkernels.zero.planning.estimate import estimate_memory, largest_unit_numel
from zkernels.zero.planning.ladder import RUNGS, NoRungFitsError, choose_rung
from zkernels.zero.planning.offload_config import (
    DEFAULT_NVME_BUFFER_BYTES, DEFAULT_SUB_GROUP_NUMEL, nvme_arena_bytes, nvme_sub_group_numel)

PSI, N = 7_500_000_000, 64


@pytest.mark.parametrize("stage, expected", [(0, 120_000_000_000), (1, 31_406_250_000),
                                             (2, 16_640_625_000), (3, 1_875_000_000)])
def test_paper_example_exact(stage, expected):
    # ZeRO paper, Figure 1: Ψ = 7.5B, N = 64, K = 12 (fp16 params and grads, fp32 Adam):
    # 120 GB, 31.4 GB, 16.6 GB, 1.9 GB (GB = 1e9 bytes).
    est = estimate_memory(PSI, N, stage, param_dtype=torch.float16,
                          reduce_dtype=torch.float16, grad_shard_dtype=torch.float16,
                          bucket_bytes=0)
    assert est.model_states_bytes == expected
    assert round(est.model_states_bytes / 1e9, 1) == {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}[stage]
    # K = 12 split as fp32 master (4) + two fp32 Adam states (8).
    assert est.master_bytes == 4 * PSI // (1 if stage == 0 else N)
    assert est.optimizer_states_bytes == 8 * PSI // (1 if stage == 0 else N)


def test_zkernels_keeps_an_fp32_gradient_shard():
    # ZeroOptimizer accumulates reduced gradients in fp32: 4Ψ/N where the paper keeps 2Ψ/N.
    e2 = estimate_memory(PSI, N, 2, param_dtype="fp16", reduce_dtype="fp16", bucket_bytes=0)
    assert e2.model_states_bytes == 2 * PSI + 16 * PSI // N


def test_traffic_per_step():
    frac = (N - 1) / N
    ests = [estimate_memory(PSI, N, s, param_dtype="fp16", reduce_dtype="fp16")
            for s in range(4)]
    for est in ests[:3]:    # 2Ψ elements of fp16 per step, ring convention
        assert est.comm_bytes == round(2 * PSI * frac * 2)
    assert ests[3].comm_bytes == round(3 * PSI * frac * 2)
    assert estimate_memory(PSI, 1, 2).comm_bytes == 0


def test_pure_fp32_design_note():
    # docs/design.md#pure-fp32: no param_dtype -> K = 8: 4Ψ + 4Ψ + 8Ψ/N (stage 1),
    # 4Ψ + 12Ψ/N (stage 2), 16Ψ/N (stage 3), plus at most one fp32 gradient shard (4Ψ/N) and
    # the bucket buffers.
    psi, n, bucket = 1_000_003, 4, 1 << 20
    shard = -(-psi // n)
    e1, e2, e3 = (estimate_memory(psi, n, s, bucket_bytes=bucket) for s in (1, 2, 3))
    assert e1.master_bytes == e2.master_bytes == e3.master_bytes == 0
    assert e1.model_states_bytes == 4 * psi + 4 * psi + 8 * shard
    # Stage 1 reduce-scatters its fp32 flat gradient in place: no pool, the shard is transient.
    assert e1.buffers_bytes == 0 and e1.transient_bytes == 4 * shard
    assert e2.model_states_bytes == 4 * psi + 12 * shard
    assert e2.buffers_bytes == 2 * bucket and e2.transient_bytes == 0
    assert e3.model_states_bytes == 16 * shard
    assert e1.device_bytes == e1.model_states_bytes + 4 * shard
    assert e1.held_device_bytes == e1.model_states_bytes
    # Casting to a different reduce dtype needs the two bucket buffers at stage 1 too.
    assert estimate_memory(psi, n, 1, param_dtype="bf16", bucket_bytes=bucket).buffers_bytes \
        == 2 * bucket


def test_offload_moves_states_off_the_device():
    kw = dict(param_dtype="bf16", reduce_dtype="bf16", bucket_bytes=0)
    e3 = estimate_memory(PSI, N, 3, **kw)
    cpu = estimate_memory(PSI, N, 3, offload="cpu", **kw)
    nvme = estimate_memory(PSI, N, 3, offload="nvme", nvme_buffer_bytes=2**26, **kw)
    staging = 2 * 2 * min(DEFAULT_SUB_GROUP_NUMEL, -(-PSI // N))   # two bf16 sub-groups
    # The stage-3 parameter shard stays on the device unless offload_params moves it too.
    assert cpu.device_bytes == e3.params_bytes
    assert cpu.host_bytes == e3.model_states_bytes - e3.params_bytes + staging
    cpu_p = estimate_memory(PSI, N, 3, offload="cpu", offload_params=True, **kw)
    assert cpu_p.device_bytes == 0 and cpu_p.host_bytes == e3.model_states_bytes  # no staging
    # NVMe: master and states on disk, the gradient shard stays on the device, host RAM is
    # the slot arena, here capped by the budget (plus the parameter shard with
    # offload_params): three slots of 3 fp32 states, an fp32 gradient and a bf16 output.
    arena = nvme_arena_bytes(nvme_sub_group_numel(2**26, 3, 2, -(-PSI // N)), 3, 2)
    assert 2**26 - 3 * 1024 * 22 - 2 * 4096 < arena <= 2**26
    assert nvme.disk_bytes == e3.master_bytes + e3.optimizer_states_bytes
    assert nvme.device_bytes == e3.grads_bytes + e3.params_bytes and nvme.host_bytes == arena
    assert nvme.disk_io_bytes == 2 * nvme.disk_bytes
    nvme_p = estimate_memory(PSI, N, 3, offload="nvme", nvme_buffer_bytes=2**26,
                             offload_params=True, **kw)
    # offload_params with NVMe: the parameter shard goes to files; host RAM adds two bounces
    # of the largest unit shard (a count without units: the whole shard) within their budget,
    # and
    # the arena's sub-groups span whole blocks of the bf16 files.
    assert nvme_p.device_bytes == e3.grads_bytes
    arena_p = nvme_arena_bytes(nvme_sub_group_numel(2**26, 3, 2, -(-PSI // N), file_bytes=2),
                               3, 2)
    assert nvme_p.host_bytes == arena_p + 2 ** 25   # the bounces' default budget, filled
    small = estimate_memory(PSI, N, 3, offload="nvme", nvme_buffer_bytes=2**26,
                            offload_params=True, nvme_param_buffer_bytes=2**20, **kw)
    assert small.host_bytes == arena_p + 2**20
    assert nvme_p.disk_bytes == nvme.disk_bytes + e3.params_bytes
    # per step: the state read and written, the files written once and read by two gathers
    assert nvme_p.disk_io_bytes == 2 * nvme.disk_bytes + 3 * e3.params_bytes
    off = estimate_memory(PSI, N, 3, offload="nvme", nvme_master=False, **kw)
    assert off.disk_bytes == nvme.disk_bytes - e3.master_bytes
    assert off.host_bytes == e3.master_bytes + nvme_arena_bytes(
        nvme_sub_group_numel(DEFAULT_NVME_BUFFER_BYTES, 2, 2, -(-PSI // N)), 2, 2)
    assert cpu.host_device_bytes == 6 * (PSI // N)     # fp32 grad shard down, bf16 params up
    # offload_params: the bf16 shard comes up at each of stage 3's two gathers per step.
    assert cpu_p.host_device_bytes == (4 + 2 * 2) * (PSI // N)
    # The optimizer's messages: ZeroConfig checks both.
    with pytest.raises(ValueError, match="offload_params=True applies only to stage=3"):
        estimate_memory(PSI, N, 2, offload="cpu", offload_params=True)
    with pytest.raises(ValueError, match="offload_params=True needs offload='cpu' or 'nvme'"):
        estimate_memory(PSI, N, 3, offload_params=True)
    e2cpu = estimate_memory(PSI, N, 2, offload="cpu", **kw)
    assert e2cpu.device_bytes == 2 * PSI and e2cpu.host_bytes == 16 * (PSI // N) + staging
    # Pure fp32: the device parameter is no longer the master, so offload keeps one.
    fp32 = estimate_memory(PSI, N, 2, offload="cpu", bucket_bytes=0)
    assert fp32.master_bytes == 4 * (PSI // N) and fp32.host_bytes == 16 * (PSI // N)


def test_by_location_says_where_each_kind_lives():
    # Each place's kinds add up to its total, and each kind (staging aside) sits in one place,
    # as the [Note: memory model] places it: here bf16 stage 3, so every kind is non-zero.
    kw = dict(param_dtype="bf16", reduce_dtype="bf16", bucket_bytes=2**20)
    for offload, op in ((None, False), ("cpu", False), ("cpu", True), ("nvme", False),
                        ("nvme", True)):
        e = estimate_memory(PSI, N, 3, offload=offload, offload_params=op, **kw)
        loc = e.by_location
        assert sum(loc["device"].values()) == e.device_bytes
        assert sum(loc["host"].values()) == e.host_bytes
        assert sum(loc["disk"].values()) == e.disk_bytes
        for kind, total in (("params", e.params_bytes), ("grads", e.grads_bytes),
                            ("master", e.master_bytes),
                            ("optimizer_states", e.optimizer_states_bytes)):
            places = [p for p in ("device", "host", "disk") if kind in loc[p]]
            assert len(places) == 1 and loc[places[0]][kind] == total, (offload, op, kind)
        where = {k: p for p in ("device", "host", "disk") for k in loc[p]}
        assert where["params"] == ("device" if not op else "disk" if offload == "nvme"
                                   else "host")
        assert where["optimizer_states"] == {None: "device", "cpu": "host",
                                             "nvme": "disk"}[offload]
        assert where["grads"] == ("host" if offload == "cpu" else "device")
    # Not part of equality: two estimates of one rung compare equal (and hash) as before.
    assert estimate_memory(PSI, N, 2) == estimate_memory(PSI, N, 2)
    assert hash(estimate_memory(PSI, N, 2)) == hash(estimate_memory(PSI, N, 2))


def test_model_input_counts_tied_weights_once_and_units():
    from zkernels.demo.model import GPT, GPTConfig
    model = GPT(GPTConfig(n_layer=3, n_embd=48, n_head=3, block_size=16))
    num = sum(p.numel() for p in model.parameters())
    assert estimate_memory(model, 2, 2).num_params == num
    blk = sum(p.numel() for p in model.blocks[0].parameters())
    root = 256 * 48 + 16 * 48 + 2 * 48    # tied wte/head, wpe, ln_f: stage 3's root unit
    assert largest_unit_numel(model) == max(blk, root)
    e3 = estimate_memory(model, 2, 3, param_dtype="bf16")
    assert e3.gathered_peak_bytes == 2 * (root + 2 * blk)   # the root and two blocks
    # One reduce buffer per unit in flight (two), each the largest unit, fp32.
    assert e3.buffers_bytes == 2 * 4 * max(blk, root)
    # ... held only while gradients are in flight: between steps stage 3 holds its formula
    assert e3.held_buffers_bytes == 0
    assert e3.held_device_bytes == e3.device_bytes - e3.transient_bytes - e3.buffers_bytes


@pytest.mark.parametrize("kwargs, match", [
    (dict(world_size=0), "world_size"), (dict(stage=4), "stage"),
    (dict(offload="disk"), "offload"), (dict(stage=1, offload="cpu"), "stage 2 or 3"),
    (dict(param_dtype=torch.int8), "param_dtype"), (dict(reduce_dtype="fp8"), "reduce_dtype"),
    (dict(bucket_bytes=-1), "bucket_bytes")])
def test_bad_input_names_the_argument(kwargs, match):
    args = dict(world_size=2, stage=2) | kwargs
    with pytest.raises(ValueError, match=match):
        estimate_memory(1000, **args)
    with pytest.raises(ValueError, match="model_or_num_params"):
        estimate_memory(-5, 2, 1)
    with pytest.raises(TypeError, match="model_or_num_params"):
        estimate_memory("7B", 2, 1)


def _need(stage, offload=None):
    return estimate_memory(PSI, N, stage, param_dtype="bf16", reduce_dtype="bf16",
                           offload=offload).device_bytes


@pytest.mark.parametrize("rung", [(1, None), (2, None), (3, None), (3, "cpu")])
def test_choose_rung_takes_the_lowest_that_fits(rung):
    budget = _need(*rung)     # exactly enough for this rung, not for the one below
    got, est, reason = choose_rung(PSI, N, budget, headroom=0.0, param_dtype="bf16",
                                   reduce_dtype="bf16")
    assert got == rung and est.device_bytes == budget
    assert "lowest rung that fits" in reason
    assert not est.offload_params
    # One byte less: a higher rung (stage 3 + offload: the same rung with the parameter shards
    # in host RAM comes first), or nothing when the next rung needs as much device memory.
    try:
        got, less, _ = choose_rung(PSI, N, budget - 1, headroom=0.0, param_dtype="bf16",
                                   reduce_dtype="bf16")
    except NoRungFitsError:
        assert rung == (3, "cpu")
    else:
        if rung == (3, "cpu"):
            assert got == rung and less.offload_params
        else:
            assert RUNGS.index(got) > RUNGS.index(rung)


def test_choose_rung_headroom_and_host_budget():
    budget = _need(1)
    assert choose_rung(PSI, N, budget, headroom=0.1, param_dtype="bf16",
                       reduce_dtype="bf16")[0] == (2, None)
    assert choose_rung(PSI, N, budget / 0.9 + 1, headroom=0.1, param_dtype="bf16",
                       reduce_dtype="bf16")[0] == (1, None)
    # cpu offload fits the device but not the host: nvme is next.
    host = estimate_memory(PSI, N, 3, param_dtype="bf16", reduce_dtype="bf16",
                           offload="cpu").host_bytes
    # (NVMe keeps the gradient shard on the device, so it needs a little more device memory
    # than cpu offload.)
    got, _, reason = choose_rung(PSI, N, _need(3, "nvme"), headroom=0.0, param_dtype="bf16",
                                 reduce_dtype="bf16", host_budget_bytes=host - 1)
    assert got == (3, "nvme"), reason


def test_choose_rung_nothing_fits():
    with pytest.raises(NoRungFitsError, match="no rung of the ladder fits"):
        choose_rung(PSI, N, 10**9, rungs=((1, None), (2, None), (3, None)))
    with pytest.raises(ValueError, match="headroom"):
        choose_rung(PSI, N, 10**9, headroom=1.0)


def test_a_tensor_larger_than_a_bucket_sets_the_buffers():
    # An LLM's embedding (32000 x 4096) is larger than a 25 MiB bucket: it gets a bucket of its
    # own, and the two reduce buffers are sized to it.
    psi, emb = 6_738_415_616, 32000 * 4096
    small = estimate_memory(psi, 8, 2)
    big = estimate_memory(psi, 8, 2, max_tensor_numel=emb)
    assert small.buffers_bytes == 2 * 25 * 2**20
    assert big.buffers_bytes == 2 * 4 * emb
    with pytest.raises(ValueError, match="stage"):
        estimate_memory(psi, 8, True)
