"""Native CPU AdamW vs torch (fused/foreach), DeepSpeed when present, and the machine's
bandwidth; see zkernels/bench/cpu_adam.py. Example:

    OMP_NUM_THREADS=2 python benchmarks/cpu_adam.py --threads 2 --out bench_results/cpu_adam.json
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from zkernels.bench.cpu_adam import main  # noqa: E402

if __name__ == "__main__":
    main()
