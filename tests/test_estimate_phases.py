"""``estimate_phases`` (zkernels/zero/planning/phases.py): bytes per rank while building on the
meta device, loading, training and saving, and ``plan``'s start-up table.

Oracles:
- the arithmetic of [Note: memory while building, loading and saving] by hand for a count;
- measured peaks of 2 gloo ranks building a ~30M-parameter Llama on meta at stage 3, loading
  bf16 files with ``load_pretrained``, taking a step and saving with ``save_pretrained``:
  build and load by peak RSS (``zkernels.bench.peak_rss``: the kernel's VmHWM, reset per
  phase), within the estimate give or take 10% and the process's own overhead (48 MiB; the
  estimate counts tensors, RSS also holds the allocator's and torch's own); save by tensor
  bytes (``stats()``'s held bytes plus ``zkernels.bench.peak_tensors``' peak while saving),
  since after a training step RSS also holds what the allocator kept of the step's
  activations;
- ``catches``: the same measurements against the estimate less one kind (the states, what
  training holds) fall outside the margin, so the comparison can fail.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

from tests.zero._harness import rank_fixture
from zkernels.zero.planning.phases import PHASES, estimate_phases

transformers = pytest.importorskip("transformers")

MIB = 2 ** 20
OVERHEAD = 48 * MIB
CFG = dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
           num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=32,
           tie_word_embeddings=False)


def llama(meta=True):
    cfg = transformers.LlamaConfig(**CFG)
    if meta:
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(cfg)
    return transformers.LlamaForCausalLM(cfg)


def test_count_by_kind_matches_the_note():
    psi, n, unit = 8_000_000, 4, 1_000_000
    ph = estimate_phases(psi, n, 3, max_unit_numel=unit, file_dtype="bf16")
    per = psi // n
    # build: every other unit's states (12 bytes an element in pure fp32), then the largest
    # unit materialized in fp32 and flattened (its fp32 buffer and its shard's clone).
    assert ph.by_phase["build"] == dict(states=12 * (psi - unit) // n, materialized=4 * unit,
                                        flat_copy=4 * (unit + unit // n))
    assert ph.by_phase["load"]["states"] == 12 * per
    assert ph.by_phase["load"]["file_pages"] == 2 * per
    assert ph.by_phase["save"] == dict(held=ph.training.held_device_bytes,
                                       gathered_unit=4 * unit, cast=0)
    assert ph.train_peak_bytes == ph.training.device_bytes
    # A bf16 save casts the largest tensor on rank 0; a bf16-built model materializes in 2.
    assert estimate_phases(psi, n, 3, max_unit_numel=unit,
                           save_dtype="bf16").by_phase["save"]["cast"] == 2 * unit
    assert estimate_phases(psi, n, 3, max_unit_numel=unit, model_dtype="bf16"
                           ).by_phase["build"]["materialized"] == 2 * unit
    # Stages 1-2 materialize the whole model before flattening.
    assert estimate_phases(psi, n, 2).by_phase["build"]["materialized"] == 4 * psi


def test_module_walks_the_build_order():
    model = llama()
    ph = estimate_phases(model, 2, 3)
    psi = sum(p.numel() for p in model.parameters())
    root = psi - sum(p.numel() for p in model.model.layers.parameters())
    # The root is built last, on top of every block's states.
    assert ph.by_phase["build"]["materialized"] == 4 * root
    assert ph.by_phase["build"]["states"] == 12 * (psi - root) // 2
    assert set(ph.by_phase) == set(PHASES)


def test_bad_arguments_name_them():
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        estimate_phases(1000, 2, 0)
    with pytest.raises(ValueError, match="phase must be one of"):
        estimate_phases(1000, 2, 3).peak_bytes("boot")
    with pytest.raises((ValueError, TypeError), match="file_dtype"):
        estimate_phases(1000, 2, 3, file_dtype="int3")


def test_plan_prints_the_startup_table(tmp_path):
    cfg = dict(CFG, model_type="llama", hidden_act="silu", rope_theta=10000.0)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    out_json = tmp_path / "plan.json"
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(__file__)))
    out = subprocess.run([sys.executable, "-m", "zkernels", "plan", "--model", str(path),
                          "--world-size", "4", "--param-dtype", "fp32", "--unit", "MiB",
                          "--json", str(out_json)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "while building on the meta device" in out.stdout
    startup = out.stdout.split("while building on the meta device", 1)[1]
    line = next(x for x in startup.splitlines() if x.strip().startswith("stage 3  "))
    build, load, train, save = (float(v) for v in line.split()[-4:])
    ph = estimate_phases(llama(), 4, 3, file_dtype="bf16")
    assert build == pytest.approx(ph.peak_bytes("build") / MIB, abs=0.1)
    assert save == pytest.approx(ph.peak_bytes("save") / MIB, abs=0.1)
    assert json.loads(out_json.read_text())["phases"]["stage 3"]["build"]["materialized"] > 0


def _write_files(folder):
    """The model's tensors as bf16 safetensors, one file per decoder layer (so no process
    ever holds the model), with an index: what ``from_pretrained`` reads."""
    from safetensors.torch import save_file
    model = llama()
    gen = torch.Generator().manual_seed(0)
    groups = {}
    for k, p in model.state_dict().items():
        parts = k.split(".")
        groups.setdefault(parts[2] if parts[1] == "layers" else "root", {})[k] = p.shape
    wm = {}
    for g, shapes in groups.items():
        name = f"model-{g}.safetensors"
        save_file({k: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16)
                   for k, s in shapes.items()}, os.path.join(folder, name))
        wm.update({k: name for k in shapes})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wm}, f)


def _phases(rank, world_size):
    """Build on meta, load, one step, save; build and load: peak RSS above the post-import
    baseline; save: tensor bytes held plus those allocated at the save's peak."""
    import torch.distributed as dist

    import zkernels as zk
    from zkernels.bench.peak_rss import PeakMeter
    from zkernels.bench.peak_tensors import TensorPeak
    folder = [tempfile.mkdtemp(prefix="zk-phases-") if rank == 0 else None]
    dist.broadcast_object_list(folder)
    folder = folder[0]
    if rank == 0:
        _write_files(folder)
    llama()   # transformers' lazy imports happen here, before the baseline, on every rank
    dist.barrier()
    meter = PeakMeter()
    try:
        with meter.phase("build"):
            model = llama()
            opt = zk.ZeroOptimizer(model, stage=3, lr=1e-4, device="cpu", param_init=None)
        with meter.phase("load"):
            zk.checkpoint.load_pretrained(opt, folder)
        with meter.phase("train"):
            x = torch.randint(CFG["vocab_size"], (1, 16), generator=torch.Generator()
                              .manual_seed(rank))
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
        held = opt.stats()["memory_bytes"]["total"]
        with TensorPeak() as saving:
            zk.checkpoint.save_pretrained(opt, os.path.join(folder, "out"),
                                          max_shard_size="20MB")
        opt.close()
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    return {k: v["peak"] for k, v in meter.peaks.items()} | {
        "exact": all(v["exact"] for v in meter.peaks.values()),
        "save": held + saving.peak_bytes}


ranks = rank_fixture({"meta": _phases}, world_size=2, timeout=300.0)


def _margin(est):
    return 0.10 * est + OVERHEAD


@pytest.mark.parametrize("row", ["meta"])
def test_measured_phases_match_the_estimate(ranks, row):
    ph = estimate_phases(llama(), 2, 3, file_dtype="bf16")
    for r, got in enumerate(ranks(row)):
        for phase in ("build", "load", "save"):
            est = ph.peak_bytes(phase)
            assert abs(got[phase] - est) <= _margin(est), \
                f"rank {r} {phase}: measured {got[phase] / MIB:.1f} MiB, estimate " \
                f"{est / MIB:.1f} MiB"


@pytest.mark.parametrize("row", ["meta"])
def test_catches_an_estimate_that_leaves_a_kind_out(ranks, row):
    # The same measurements against the estimate less one kind: each comparison fails.
    ph = estimate_phases(llama(), 2, 3, file_dtype="bf16")
    for phase, kind in (("build", "states"), ("load", "states"), ("save", "held")):
        broken = ph.peak_bytes(phase) - ph.by_phase[phase][kind]
        assert all(abs(got[phase] - broken) > _margin(broken) for got in ranks(row)), \
            (phase, kind)
