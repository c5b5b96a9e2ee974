"""Rank entry points for tests/test_launch_report.py, run by ``zkernels.launch.run_ranks``."""
import os
import time
from datetime import timedelta


def _group():
    import torch.distributed as dist

    from zkernels.launch import init_method
    dist.init_process_group("gloo", init_method=init_method(), rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timedelta(seconds=60))
    return dist


def one_rank_raises(argv) -> int:
    """Rank ``argv[0]`` raises after the first barrier; the others wait for it at the second
    and lose their peer ("Connection closed by peer")."""
    from zkernels.launch import failure_recorded
    dist = _group()
    try:
        with failure_recorded():
            dist.barrier()
            if dist.get_rank() == int(argv[0]):
                raise ValueError(f"deliberate failure on rank {argv[0]}")
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def one_rank_exits(argv) -> int:
    """Rank 0 leaves with ``os._exit(3)`` (no exception); the others sleep, touching no
    collective: only the launcher can stop them."""
    if os.environ["RANK"] == "0":
        os._exit(3)
    time.sleep(float(argv[0]))
    return 0


def every_rank_sleeps(argv) -> int:
    time.sleep(float(argv[0]))
    return 0
