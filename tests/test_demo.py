"""``python -m zkernels demo`` end to end: 2 gloo ranks through torch.distributed.run, a tiny
GPT, every rung; the JSON table shows equal fp32 losses and memory measured vs estimated."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--steps", "3", "--n-layer", "1", "--n-embd", "32", "--n-head", "2",
        "--block-size", "16", "--batch-size", "2", "--bucket-bytes", "16384"]
# [Note: demo loss tolerance]
# The rungs reduce the same gradients (DDP's all-reduce and ZeRO's reduce-scatter both sum 2
# values per element, which is commutative, then halve exactly) and differ only in the order of
# AdamW's fp32 arithmetic, so losses and parameters agree to fp32 round-off over a few steps.
LOSS_ATOL = 1e-5
PARAM_ATOL = 1e-5


def _demo(tmp_path, *extra, timeout=120):
    out = tmp_path / "demo.json"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "zkernels", "demo", *TINY, "--json", str(out),
                           *extra], capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, json.loads(out.read_text())


def test_demo_all_rungs_agree(tmp_path):
    stdout, data = _demo(tmp_path)
    rungs = {r["name"]: r for r in data["rungs"]}
    assert list(rungs) == ["data parallel", "stage 1", "stage 2"]
    assert data["meta"]["world_size"] == 2
    losses = [r["losses"] for r in rungs.values()]
    assert all(len(x) == 3 for x in losses)
    for other in losses[1:]:
        assert max(abs(a - b) for a, b in zip(losses[0], other)) <= LOSS_ATOL
    assert data["summary"]["max_loss_diff"] <= LOSS_ATOL
    assert data["summary"]["max_param_diff"] <= PARAM_ATOL
    for r in rungs.values():
        assert r["step_time_s"] > 0
        # Bytes sent per step: the ring volume of the gradients (and, at stages 1-2, of the
        # gathered parameters); padding and the tiny grad-norm all-reduce aside.
        assert abs(r["comm_bytes"] - r["estimate"]["comm_bytes"]) <= \
            0.05 * r["estimate"]["comm_bytes"]
        # Bytes held between steps, measured from allocated tensors, vs the estimate.
        assert abs(r["memory_bytes"]["total"] - r["estimate"]["total"]) <= \
            0.02 * r["estimate"]["total"]
    # Sharding shrinks the model states (the reduce buffers, fixed-size, aside: at this tiny
    # size they outweigh what stage 2 saves).
    dp, s1, s2 = (rungs[k]["memory_bytes"]["total"] - rungs[k]["memory_bytes"]["buffers"]
                  for k in rungs)
    assert s2 < s1 < dp
    assert "max |loss difference|" in stdout and "stage 2" in stdout


def test_demo_bad_option(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "zkernels", "demo", "--steps", "0"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2 and "--steps" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "zkernels", "demo", "--rungs", "ddp,3"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2 and "--rungs" in proc.stderr


def test_demo_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "demo.png"
    _, data = _demo(tmp_path, "--rungs", "ddp,2", "--plot", str(png))
    assert png.stat().st_size > 1000 and data["rungs"][0]["name"] == "data parallel"
    assert len(data["rungs"][1]["step_times_s"]) == 2      # the steps after the first


def test_demo_output_paths_are_checked_before_training(tmp_path):
    # A missing folder is one usage line (exit 2) at once, not a traceback after training.
    env = dict(os.environ, PYTHONPATH=ROOT)
    for flag in ("--plot", "--json"):
        target = tmp_path / "missing" / "out.png"
        proc = subprocess.run([sys.executable, "-m", "zkernels", "demo", *TINY, flag,
                               str(target)], capture_output=True, text=True, env=env,
                              timeout=60, cwd=tmp_path)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert f"argument {flag}" in proc.stderr and "does not exist" in proc.stderr
        assert "loss@" not in proc.stdout and "Traceback" not in proc.stderr
        assert not target.parent.exists()


def test_demo_table_says_what_the_losses_show():
    from zkernels.demo.report import render_table
    rung = dict(final_loss=1.0, step_time_s=0.1, comm_bytes=0, max_param_diff=0.0,
                num_params=10, memory_bytes=dict(total=1024), estimate=dict(total=1024,
                                                                             comm_bytes=0))
    results = dict(meta=dict(args=dict(steps=4), world_size=2, device="cpu"), rungs=[
        dict(rung, rung="ddp", name="data parallel", losses=[3.0, 2.0, 1.5, 1.25]),
        dict(rung, rung="1", name="stage 1", losses=[3.0, 2.0, 1.5, 1.2505]),
        dict(rung, rung="2", name="stage 2", losses=[3.0, 2.0, 1.5, 1.2505])])
    text, summary = render_table(results)
    assert "sent/step KiB" in text and " KB" not in text
    assert "stage 1 identical for 3 steps, then within 0.0005 (vs data parallel)" in text
    assert "stage 2 identical at every step (vs stage 1)" in text
    assert summary["max_loss_diff"] == pytest.approx(0.0005)


def test_corpus_tokenizer_and_batches():
    import hashlib

    import torch

    from zkernels.demo.data import decode, encode, get_batch, load_corpus
    tokens = load_corpus()
    raw = bytes(tokens.to(torch.uint8).tolist())
    assert hashlib.md5(raw).hexdigest() == "6efa8d8b558bfbf02d550c9c378a5adb"  # data/README.md
    assert raw.endswith(b"\n") and tokens.max() < 256
    assert decode(encode("Shakespeare, é")) == "Shakespeare, é"
    kw = dict(seed=3, step=7, batch_size=2, block_size=16)
    x_all, y_all = get_batch(tokens, rank=0, world_size=1, **dict(kw, batch_size=4))
    for rank in range(2):   # N ranks with batch b see exactly the global batch N·b
        x, y = get_batch(tokens, rank=rank, world_size=2, **kw)
        assert torch.equal(x, x_all[2 * rank:2 * rank + 2])
        assert torch.equal(y[:, :-1], x[:, 1:])


def test_demo_rank_failure_is_reported(tmp_path):
    # Every rank raises (a context longer than the corpus; the later --block-size wins): the launcher says so
    # and exits non-zero instead of hanging or printing a table.
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "zkernels", "demo", *TINY,
                           "--block-size", "400000", "--timeout-s", "60"],
                          capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "the demo's ranks failed" in proc.stderr and "loss@" not in proc.stdout
