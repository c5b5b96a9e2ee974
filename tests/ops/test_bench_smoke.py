"""The kernel benchmark runs end to end at a tiny size and writes the rows it prints (a
benchmark is not a test; this only keeps ``python -m zkernels.bench`` from rotting)."""
import json

import pytest
import torch

from zkernels.bench import kernels
from zkernels.bench.__main__ import main


@pytest.mark.slow  # runs the whole kernel bench once
def test_bench_writes_a_row_per_op(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("ZKERNELS_BACKEND", raising=False)
    path = tmp_path / "rows.json"
    # --threads as it is: the benchmark sets torch's thread count, which outlives the test.
    main(["--sizes", "5000", "--repeat", "1", "--warmup", "0", "--device", "cpu",
          "--threads", str(torch.get_num_threads()), "--json", str(path)])
    rows = json.loads(path.read_text())
    assert rows[0]["kind"] == "meta" and rows[0]["torch"] and rows[0]["git_revision"]
    ops = {r["op"] for r in rows[1:] if r.get("backend") == "reference"}
    assert ops == set(kernels.OPS)
    for r in rows[1:]:   # (the low-bit rows: whole blocks of the size asked for)
        numel = 5000 - 5000 % r["block"] if "block" in r else 5000
        assert r["median_ms"] > 0 and r["gbps"] > 0 and r["numel"] == numel, r
    # exactly one row per op is the implementation zkernels.ops picks by itself
    kernel_rows = [r for r in rows[1:] if r.get("section") == "kernels" and r["op"] != "copy_"]
    assert sorted(r["op"] for r in kernel_rows if r["default"] == "yes") == sorted(kernels.OPS)
    assert all(r["bound"] in ("memory", "overhead") and r["peer_bytes"] >= r["num_bytes"]
               for r in kernel_rows)
    out = capsys.readouterr().out
    assert "== kernels" in out and "speedup" in out


def _usage_error(capsys, *argv):
    """argparse's refusal: exit status 2, the last stderr line names the option."""
    import pytest
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    assert exc.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_bench_refuses_bad_options_before_running(tmp_path, monkeypatch, capsys):
    # Nothing runs (a section that ran would fail the test), nothing is created.
    monkeypatch.setattr(kernels, "run", lambda args: (_ for _ in ()).throw(AssertionError))
    missing = tmp_path / "missing" / "rows.json"
    err = _usage_error(capsys, "--json", str(missing))
    assert "argument --json" in err and "does not exist" in err
    assert not missing.parent.exists()
    err = _usage_error(capsys, "--ops", "flatten", "nosuchop")
    assert "argument --ops: unknown nosuchop" in err and "flatten" in err
    assert "argument --device" in _usage_error(capsys, "--device", "tpu")
    if not torch.cuda.is_available():
        err = _usage_error(capsys, "--device", "cuda")
        assert "argument --device" in err and "no CUDA device" in err
    assert "argument --repeat" in _usage_error(capsys, "--repeat", "0")
