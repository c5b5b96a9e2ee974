"""What a bad checkpoint does: every error says what is wrong, nothing is ever unpickled, and
a save killed mid-write leaves the previous checkpoint loadable.

Single-process checkpoints (world size 1, no torch.distributed) except the killed save.
"""
import json
import os
import pickle
import shutil
import zlib

import pytest
import torch

import zkernels as zk
from tests._dist import _free_port, _worker
from tests.checkpoint import _ranks
from zkernels.checkpoint import (CheckpointError, CorruptCheckpointError,
                                 IncompatibleCheckpointError, NotACheckpointError,
                                 UnsupportedVersionError, manifest)
from zkernels.demo.model import GPT, GPTConfig


def _small(seed=0, **cfg):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**dict(vocab_size=97, block_size=13, n_layer=1, n_head=3,
                                    n_embd=36), **cfg}))
    return model, zk.ZeroOptimizer(model, stage=2, lr=1e-3, bucket_bytes=3000)


@pytest.fixture
def ckpt(tmp_path):
    model, opt = _small()
    x = torch.randint(0, 97, (2, 13))
    model(x, x).backward()
    opt.step()
    opt.zero_grad()
    path = tmp_path / "ckpt"
    zk.checkpoint.save(opt, path)
    return path


def _shard(path):
    return path / manifest.shard_file(0, 1)


def _edit_manifest(path, edit):
    """Change the manifest and re-seal it (its CRC), so the check under test is the one
    that fires."""
    m = json.loads((path / manifest.MANIFEST).read_text())
    m.pop("manifest_crc32")
    edit(m)
    (path / manifest.MANIFEST).write_bytes(manifest.dumps(m))


def _load(path, **cfg):
    _, opt = _small(seed=1, **cfg)
    return zk.checkpoint.load(opt, path)


def test_round_trip_and_verify(ckpt):
    _load(ckpt)
    info = zk.checkpoint.verify(ckpt)
    assert info["files"] == 2 and info["bytes"] > 0


def test_flipped_byte_is_detected(ckpt):
    shard = _shard(ckpt)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    for act in (lambda: _load(ckpt), lambda: zk.checkpoint.consolidate(ckpt),
                lambda: zk.checkpoint.verify(ckpt)):
        with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch in block 0 .*"
                                                         r"shard-00000-of-00001|shard-00000-of"
                                                         r"-00001.*checksum mismatch"):
            act()


def test_flipped_manifest_is_detected(ckpt):
    raw = (ckpt / manifest.MANIFEST).read_text()
    (ckpt / manifest.MANIFEST).write_text(raw.replace('"stage": 2', '"stage": 3'))
    with pytest.raises(CorruptCheckpointError, match="fails its checksum"):
        _load(ckpt)


def test_missing_and_truncated_shard(ckpt):
    shard = _shard(ckpt)
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    with pytest.raises(CorruptCheckpointError, match=r"is truncated: \d+ bytes, the manifest "
                                                     r"says \d+"):
        _load(ckpt)
    shard.unlink()
    with pytest.raises(CorruptCheckpointError, match="is missing: the manifest lists it"):
        _load(ckpt)


def test_model_mismatch_lists_differences(ckpt):
    with pytest.raises(IncompatibleCheckpointError, match=r"shapes differ: wte.weight "
                                                          r"\(checkpoint \(97, 36\), model "
                                                          r"\(97, 48\)\)"):
        _load(ckpt, n_embd=48, n_head=4)
    with pytest.raises(IncompatibleCheckpointError,
                       match=r"trainable here, missing from the checkpoint: blocks\.1\..*"
                             r"and \d+ more"):
        _load(ckpt, n_layer=2)
    model, opt = _small(seed=1)
    model.register_buffer("extra_buf", torch.zeros(2))
    with pytest.raises(IncompatibleCheckpointError, match="in the model's state_dict, not in "
                                                          "the checkpoint: extra_buf"):
        zk.checkpoint.load(opt, ckpt)


def test_param_group_mismatch(ckpt):
    torch.manual_seed(1)
    model = GPT(GPTConfig(vocab_size=97, block_size=13, n_layer=1, n_head=3, n_embd=36))
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    opt = zk.ZeroOptimizer(model, stage=1, param_groups=[{"params": decay},
                                                         {"params": rest}])
    with pytest.raises(IncompatibleCheckpointError, match="1 param groups, the optimizer 2"):
        zk.checkpoint.load(opt, ckpt)


def test_newer_format_version(ckpt):
    _edit_manifest(ckpt, lambda m: m.update(format_version=manifest.FORMAT_VERSION + 1))
    with pytest.raises(UnsupportedVersionError, match=r"format version 2, newer than this "
                                                      r"zkernels reads \(1\): upgrade"):
        _load(ckpt)


def test_not_a_checkpoint(tmp_path, ckpt):
    with pytest.raises(NotACheckpointError, match="does not exist"):
        _load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotACheckpointError, match="has no manifest.json"):
        _load(tmp_path / "empty")
    torch.save({"a": 1}, tmp_path / "model.pt")
    with pytest.raises(NotACheckpointError, match="is a file, not a zkernels checkpoint"):
        _load(tmp_path / "model.pt")
    (ckpt / manifest.MANIFEST).write_text(json.dumps({"format": "something else"}))
    with pytest.raises(NotACheckpointError, match="not a zkernels checkpoint manifest"):
        _load(ckpt)


def test_manifest_pointing_outside_is_refused(tmp_path, ckpt):
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(_shard(ckpt), outside)
    def redirect(m, to):
        name, = (f for f in m["files"] if f != manifest.MODEL_FILE)
        m["files"][to] = m["files"].pop(name)
        for p in m["params"].values():
            for piece in p["pieces"]:
                piece["file"] = to

    _edit_manifest(ckpt, lambda m: redirect(m, "../elsewhere.safetensors"))
    with pytest.raises(CorruptCheckpointError, match=r"names file '\.\./elsewhere\.safetensors'"
                                                     r".*not a plain file name.*refused"):
        _load(ckpt)
    _edit_manifest(ckpt, lambda m: redirect(m, str(outside)))
    with pytest.raises(CorruptCheckpointError, match="refused"):
        _load(ckpt)
    # A symlink planted inside the folder that leads out of it.
    os.symlink(outside, ckpt / "link.safetensors")
    _edit_manifest(ckpt, lambda m: redirect(m, "link.safetensors"))
    with pytest.raises(CorruptCheckpointError, match="resolves outside the checkpoint folder"):
        _load(ckpt)


class _Payload:
    """Unpickling this runs ``open(marker, 'w')``: the classic pickle exploit, harmless."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_planted_pickle_is_never_executed(tmp_path, ckpt, monkeypatch):
    marker = tmp_path / "PWNED"
    payload = pickle.dumps(_Payload(str(marker)))
    assert not marker.exists()
    # 1. In place of a shard, with the manifest re-sealed to match it (size and checksums),
    #    so only the reader's refusal to interpret anything but JSON and raw numbers stands
    #    between the payload and execution.
    _shard(ckpt).write_bytes(payload)

    def reseal(m):
        m["files"][manifest.shard_file(0, 1)] = {
            "size": len(payload), "block_crc32": [zlib.crc32(payload)]}

    _edit_manifest(ckpt, reseal)
    # Any unpickling at all would fail loudly here (and the marker would appear).
    def no_pickle(*a, **k):
        raise AssertionError("zkernels.checkpoint unpickled something")
    monkeypatch.setattr(pickle, "load", no_pickle)
    monkeypatch.setattr(pickle, "loads", no_pickle)
    monkeypatch.setattr(pickle, "Unpickler", no_pickle)
    monkeypatch.setattr(torch, "load", no_pickle)
    for act in (lambda: _load(ckpt), lambda: zk.checkpoint.consolidate(ckpt),
                lambda: zk.checkpoint.verify(ckpt)):
        with pytest.raises(CorruptCheckpointError, match="is not a tensor file"):
            act()
    # 2. In place of the manifest.
    (ckpt / manifest.MANIFEST).write_bytes(payload)
    with pytest.raises(CorruptCheckpointError, match="is not valid JSON"):
        _load(ckpt)
    assert not marker.exists()


def test_save_refuses_to_replace_a_non_checkpoint(tmp_path):
    model, opt = _small()
    precious = tmp_path / "data"
    precious.mkdir()
    (precious / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="is not a zkernels checkpoint.*refusing"):
        zk.checkpoint.save(opt, precious)
    assert (precious / "keep.txt").read_text() == "mine"


def test_model_extra_must_be_storable(tmp_path):
    _, opt = _small()
    with pytest.raises(TypeError, match=r"model_extra\['f'\] holds a builtin_function"):
        zk.checkpoint.save(opt, tmp_path / "c", model_extra={"f": len})
    assert not (tmp_path / "c").exists()


def test_replace_and_recover_interrupted_publish(tmp_path):
    """A save over an existing checkpoint replaces it; a publish interrupted between its two
    renames (see [Note: atomic checkpoint publish]) still loads, and the next save heals it."""
    model, opt = _small()
    path = tmp_path / "ckpt"
    zk.checkpoint.save(opt, path, model_extra=1)
    zk.checkpoint.save(opt, path, model_extra=2)
    assert _load(path) == 2
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    os.rename(path, str(path) + ".zk-old")   # the state between the two renames
    assert _load(path) == 2
    zk.checkpoint.save(opt, path, model_extra=3)
    assert _load(path) == 3 and sorted(os.listdir(tmp_path)) == ["ckpt"]


@pytest.mark.slow  # fault timing: a rank killed mid-save
def test_killed_rank_leaves_previous_checkpoint(tmp_path):
    """World size 2: rank 1 SIGKILLs itself halfway through writing its shard of the second
    save. Rank 0 fails with SaveAbortedError within the process group's timeout; the first
    checkpoint is still the one at the path, loads at world size 1, and a new save succeeds."""
    import multiprocessing as mp
    folder = str(tmp_path / "ckpt")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(_ranks.killed_save, r, 2, port, (folder,),
                                                queue, 20.0), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        rank, ok, payload = queue.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert procs[1].exitcode == -9, "rank 1 was to die by SIGKILL"
    assert (rank, ok) == (0, True), payload
    assert payload["error"] is not None, "the save with a dead rank must fail"
    assert "previous checkpoint" in payload["error"] and "intact" in payload["error"]
    good = _ranks.tensors(payload["good"])
    assert os.path.isdir(folder + ".zk-tmp"), "the half-written save stays aside"
    now = zk.checkpoint.consolidate(folder)
    assert list(now) == list(good)
    for k in good:
        assert torch.equal(now[k].float() if now[k].is_floating_point() else now[k], good[k]), k
    model, opt = _ranks.build(7, stage=1, dtype="fp32", bucket_bytes=_ranks.RESUME_BUCKET)
    assert zk.checkpoint.load(opt, folder) == {"step": 1}
    zk.checkpoint.save(opt, folder, model_extra={"step": "again"})
    assert not os.path.exists(folder + ".zk-tmp")
    assert zk.checkpoint.load(opt, folder) == {"step": "again"}
