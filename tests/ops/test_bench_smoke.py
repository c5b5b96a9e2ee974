"""The kernel benchmark runs end to end at a tiny size and writes the rows it prints (a
benchmark is not a test; this only keeps ``python -m zkernels.bench`` from rotting)."""
import json

import torch

from zkernels.bench import kernels
from zkernels.bench.__main__ import main


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
    for r in rows[1:]:
        assert r["median_ms"] > 0 and r["gbps"] > 0 and r["numel"] == 5000
    # exactly one row per op is the implementation zkernels.ops picks by itself
    kernel_rows = [r for r in rows[1:] if r.get("section") == "kernels" and r["op"] != "copy_"]
    assert sorted(r["op"] for r in kernel_rows if r["default"] == "yes") == sorted(kernels.OPS)
    assert all(r["bound"] in ("memory", "overhead") and r["peer_bytes"] >= r["num_bytes"]
               for r in kernel_rows)
    out = capsys.readouterr().out
    assert "== kernels" in out and "speedup" in out
