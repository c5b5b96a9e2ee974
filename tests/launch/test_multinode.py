"""Multi-node launch on torchrun's own machinery: two torchrun agents on this machine act as
two "nodes" (c10d rendezvous on 127.0.0.1, 2 processes each) and train at stages 2 and 3 to
the same losses and parameters, bit for bit, as one 4-process launch: ZeroOptimizer sees only
ranks and a process group, however the processes were started.

With ``--rdzv-backend c10d``, torchrun assigns node ranks in rendezvous order (``--node-rank``
counts only for the static backend); ``is_host`` says which agent serves the rendezvous
store, since both would otherwise find 127.0.0.1 to be their own address.
"""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from tests._stages import stage_params

pytestmark = pytest.mark.slow  # two torchrun agents as two nodes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "launch", "_train.py")
LAUNCH_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", *args]


def _env():
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")


def _wait(procs):
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=LAUNCH_TIMEOUT_S)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]


def _where(out_dir, ws):
    rows = []
    for r in range(ws):
        with open(os.path.join(out_dir, f"where-rank{r}.json")) as f:
            rows.append(json.load(f))
    return rows


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("stage", stage_params((2, 3)))
def test_two_nodes_match_one_four_process_launch(tmp_path, stage):
    single, multi = tmp_path / "single", tmp_path / "multi"
    single.mkdir()
    multi.mkdir()
    stages = [str(stage)]
    _wait([subprocess.Popen(
        _torchrun("--standalone", "--nproc-per-node", "4", SCRIPT, str(single),
                  "--stages", *stages),
        env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)])
    port = _free_port()
    nodes = [subprocess.Popen(
        _torchrun("--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
                  "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                  "--rdzv-id", "zk-multinode", "--rdzv-conf", f"is_host={node == 0}",
                  "--local-addr", "127.0.0.1", "--max-restarts", "0", SCRIPT, str(multi),
                  "--stages", *stages),
        env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)]
    _wait(nodes)
    where = _where(multi, 4)
    assert {w["world_size"] for w in where} == {4}
    assert sorted((w["node"], w["local_rank"]) for w in where) == [(0, 0), (0, 1), (1, 0),
                                                                    (1, 1)], where
    assert len({w["agent_pid"] for w in where}) == 2, "two agents, one per node"
    assert len({w["agent_pid"] for w in _where(single, 4)}) == 1
    a = torch.load(single / "result.pt", weights_only=False)
    b = torch.load(multi / "result.pt", weights_only=False)
    (losses_a, params_a), (losses_b, params_b) = a[stage], b[stage]
    assert losses_a == losses_b, (losses_a, losses_b)
    assert losses_a[-1] < losses_a[0], losses_a
    assert params_a.keys() == params_b.keys()
    for name in params_a:
        assert torch.equal(params_a[name], params_b[name]), name
