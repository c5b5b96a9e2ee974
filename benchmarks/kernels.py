"""Kernel microbenchmark: every fused op against its PyTorch peer, same run. A thin entry to
``python -m zkernels.bench --sections kernels``; same arguments. Example:

    python benchmarks/kernels.py --threads 2 --json bench_results/kernels.json
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from zkernels.bench.__main__ import main  # noqa: E402

if __name__ == "__main__":
    main(["--sections", "kernels"] + sys.argv[1:])
