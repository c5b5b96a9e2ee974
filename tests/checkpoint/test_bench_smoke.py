"""benchmarks/checkpoint.py runs end to end on a tiny model and reports each op beside its
peer."""
import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_checkpoint_benchmark_runs(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(
        "bench_checkpoint", os.path.join(ROOT, "benchmarks", "checkpoint.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "ck.json"
    rows = mod.main(["--numel", "2100000", "--repeat", "1", "--out", str(out)])
    pairs = {(r["op"], r["peer"]) for r in rows}
    assert {("save", "zkernels"), ("save", "torch.save"), ("load", "zkernels"),
            ("load", "torch.load"), ("consolidate", "zkernels")} <= pairs
    assert all(r["median_ms"] > 0 for r in rows)
    data = json.loads(out.read_text())
    assert data[0]["kind"] == "meta" and data[0]["numel"] == 2 * 1024 * 1025
    assert "save" in capsys.readouterr().out
