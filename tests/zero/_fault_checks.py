"""Rank side of the dead/stuck-rank tests (module-level so spawned ranks can import it).

One rank (the victim) breaks at step ``FAULT_STEP`` in one of four ways; every rank reports
what it saw, and the parent (tests/zero/test_faults.py) checks that the others raised a
:class:`zkernels.comm.CollectiveError` naming the collective, within the timeout.
"""
from __future__ import annotations

import os
import signal
import time

import zkernels as zk
from zkernels.comm import CollectiveError
from zkernels.comm import torch_comm
from tests.zero._harness import EPS, LR, MICRO_BATCH, chunk, make_batches, make_model

FAULT_STEP = 1  # step 0 runs clean, so every connection is up before the fault
SMALL_BUCKET = 3000  # several buckets: stage 2 has reductions in flight during backward
FAULTS = ("kill_backward", "kill_step", "kill_gather", "raise_forward")


class InjectedFault(RuntimeError):
    """The error the victim raises in forward (``raise_forward``)."""


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_on_collective(when) -> None:
    """SIGKILL this process when it launches a collective and ``when(kind)`` is true (patches
    the torch.distributed comm class in this process only)."""
    for kind in ("reduce_scatter", "all_gather", "all_reduce"):
        original = getattr(torch_comm.TorchComm, kind)

        def patched(self, *args, _original=original, _kind=kind, **kwargs):
            if when(_kind):
                _die()
            return _original(self, *args, **kwargs)

        setattr(torch_comm.TorchComm, kind, patched)


def faulty_training(rank, ws, stage, fault, victim, timeout_s, linger_s):
    """Train 3 steps of the harness GPT; the victim breaks at FAULT_STEP by ``fault``:

    - ``kill_backward``: SIGKILL in backward, when the gradient reaches ``blocks[0]``'s output
      (stage 2 has launched reduce-scatters of later blocks by then);
    - ``kill_step``: SIGKILL inside ``step()``, at its first collective (after the gradient
      reduction at stages 1-2: mid-step), or at its end if it issues none;
    - ``kill_gather``: SIGKILL at the second all-gather of FAULT_STEP's forward (stage 3:
      the gather of the second unit);
    - ``raise_forward``: an exception in ``blocks[1]``'s forward; the victim then lingers
      ``linger_s`` seconds without entering a collective (a stuck rank, holding its
      connections open), so only the timeout can free the others.

    Returns:
        the victim (raise_forward): ``{"injected": True}``; a survivor:
        ``{"collective", "tag", "message", "elapsed"}`` of the CollectiveError it raised, with
        ``elapsed`` the seconds from FAULT_STEP's start to the error; ``{"finished": True}``
        when training completed (a failure of the test).
    """
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=stage, lr=LR, eps=EPS, bucket_bytes=SMALL_BUCKET,
                           timeout=timeout_s)
    state = {"step": 0, "in_step": False, "forward_gathers": 0}
    if rank == victim:
        at_fault = lambda: state["step"] == FAULT_STEP  # noqa: E731
        if fault == "kill_backward":
            def kill_in_backward(module, inputs, out):
                if at_fault():
                    out.register_hook(lambda grad: _die())
            model.blocks[0].register_forward_hook(kill_in_backward)
        elif fault == "kill_step":
            _kill_on_collective(lambda kind: state["in_step"] and at_fault())
            opt.register_step_post_hook(lambda *a: _die() if at_fault() else None)
        elif fault == "kill_gather":
            def second_forward_gather(kind):
                if kind == "all_gather" and at_fault() and not state["in_step"]:
                    state["forward_gathers"] += 1
                return state["forward_gathers"] == 2
            _kill_on_collective(second_forward_gather)
        elif fault == "raise_forward":
            def boom(module, inputs):
                if at_fault():
                    raise InjectedFault(f"rank {rank} raises in forward")
            model.blocks[1].register_forward_pre_hook(boom)
        else:
            raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")

    def enter(*a):
        state["in_step"] = True

    def leave(*a):
        state["in_step"] = False

    opt.register_step_pre_hook(enter)
    opt.register_step_post_hook(leave)
    start = None
    try:
        for step, batch in enumerate(make_batches(3, ws * MICRO_BATCH)):
            state["step"] = step
            if step == FAULT_STEP:
                start = time.monotonic()
            loss = model(*chunk(batch, rank))
            loss.backward()
            opt.step()
            opt.zero_grad()
    except InjectedFault:
        time.sleep(linger_s)
        return {"injected": True}
    except CollectiveError as exc:
        return {"collective": exc.collective, "tag": exc.tag, "message": str(exc),
                "elapsed": time.monotonic() - start}
    return {"finished": True}
