"""Shared pieces of the ZeRO tests: the awkward-size GPT, its data, the single-process
references, and a runner that executes many named checks in one spawn.

Every check runs on every rank with the same seeds, so each rank computes the reference
itself (the model is tiny) and compares its own parameters to it.
"""
from __future__ import annotations

import copy
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tests._dist import rank_threads, run_ranks
from zkernels.demo.model import GPT, GPTConfig

# Sizes that divide by nothing: 36 = 3 heads x 12, vocab 97 (prime), 13 positions.
CFG = GPTConfig(vocab_size=97, block_size=13, n_layer=2, n_head=3, n_embd=36)
MICRO_BATCH = 2
# [Note: eps in the parity tests]
# The key bias of attention gets a gradient that is exactly zero in exact arithmetic (softmax
# ignores a per-query constant); in fp32 it is round-off (~1e-11) that depends on summation
# order. Adam divides by sqrt(v) + eps, so with torch's eps=1e-8 that noise becomes an update
# of ~1e-3 * lr whatever its sign, which no reduction order can reproduce. eps=1e-6 keeps
# the amplified noise below 1e-8 per step, so the comparison measures our arithmetic, not
# Adam's sensitivity to noise at zero.
EPS = 1e-6
LR = 3e-3


def make_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG)



def freeze_layers(model):
    """Block 0 wholly frozen, block 1 partly (a norm and a weight without its bias), the
    position embedding frozen; the token embedding (tied to the head) stays trainable, so every
    block's input needs a gradient (reentrant checkpointing needs one). At stage 3 block 0 is
    a unit with a frozen flat only, block 1 and the root one trainable and one frozen flat."""
    model.blocks[0].requires_grad_(False)
    model.blocks[1].ln_2.requires_grad_(False)
    model.blocks[1].fc.weight.requires_grad_(False)
    model.wpe.weight.requires_grad_(False)
    return model


class VariantGPT(GPT):
    """The harness GPT with another block sequence (``order``: a block may run twice) and
    optional activation checkpointing of each block (``ckpt``: None, "reentrant",
    "non_reentrant")."""

    order = (0, 1)
    ckpt = None

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for i in self.order:
            blk = self.blocks[i]
            if self.ckpt is None:
                x = blk(x)
            else:
                x = checkpoint(blk, x, use_reentrant=self.ckpt == "reentrant")
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))


def variant(model, order=(0, 1), ckpt=None):
    """``model`` (a harness GPT) as a :class:`VariantGPT` running ``order`` with ``ckpt``."""
    model.__class__ = VariantGPT
    model.order, model.ckpt = tuple(order), ckpt
    return model


def make_batches(num_steps: int, num_samples: int, seed: int = 1) -> List[Tuple[torch.Tensor,
                                                                                torch.Tensor]]:
    """``num_steps`` full batches (idx, targets), each int64 [num_samples, block_size]."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_samples, CFG.block_size)
    return [(torch.randint(0, CFG.vocab_size, shape, generator=g),
             torch.randint(0, CFG.vocab_size, shape, generator=g)) for _ in range(num_steps)]


def chunk(batch, index: int, size: int = MICRO_BATCH):
    x, y = batch
    return x[index * size:(index + 1) * size], y[index * size:(index + 1) * size]


def world_mean(value: float, world_size: int) -> float:
    """Mean of a Python float over ranks (outside the optimizer's meter)."""
    if world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / world_size


def no_decay(name: str) -> bool:
    """Biases and LayerNorm parameters get no weight decay."""
    return name.endswith("bias") or ".ln_" in name or name.startswith("ln_")


def split_groups(model, weight_decay: float) -> List[dict]:
    decay, plain = [], []
    for n, p in model.named_parameters():
        if p.requires_grad:
            (plain if no_decay(n) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": plain, "weight_decay": 0.0}]


# [Note: same-order reference]
# Adam turns gradient round-off into parameter differences: at step 1 the update of an element
# is lr * g / (|g| + eps), whose derivative in g is lr * eps / (|g| + eps)^2, up to
# lr / (4 eps) = 750 (LR 3e-3, EPS 1e-6) where |g| is near eps. A gradient element that is
# small because large per-sample terms cancel (~1e-3 each, so fp32 round-off ~1e-10 per sum)
# therefore moves by up to ~1e-7 for a summation-order change alone. The ranks compute each
# micro-batch's gradient with a matmul over 2 samples; one process over the whole batch of
# N * micro * 2 samples calls BLAS on other shapes, which block and vectorize the reduction
# differently per CPU (AVX-512 vs AVX2 kernels, thread count): on an AVX-512 EPYC that gave one
# element of 5184 a 1.6e-9 gradient difference, amplified to 1.24e-6 > atol after step 0.
# So the reference computes the gradient of every (rank, micro-batch) chunk with the same
# shapes, in the same process with the same thread count, as the ranks do: those chunk
# gradients are the same BLAS calls on the same inputs, bit for bit on any CPU. It accumulates
# each rank's micro-batches in fp32 in the ranks' order (autograd adds them into .grad), then
# sums the ranks' gradients in fp64 and rounds once: the ranks' reduction (a gloo ring in
# fp32, times 1/N exact for N = 1, 2, 4) differs from that only by its summation order, at
# most N - 1 fp32 roundings of partial sums, and the optimizer's AdamW differs from torch's
# by its own round-off. Measured (worst |zero - ref| / (atol + rtol |ref|) over every fp32
# check at world size 4, step by step): 0.13 on this AVX-512 CPU, 0.26 with
# ATEN_CPU_CAPABILITY=avx2 (also with ZKERNELS_CPU_ISA=scalar), 0.13 with =default, 0.12 with
# ZKERNELS_BACKEND=reference, 0.17 with 2 threads per rank (world size 2); the whole-batch
# reference exceeded 1 (the failure above). So the tolerance stays tol(float32), with 4x
# headroom; what the reference no longer covers is BLAS's shape-dependent round-off, which is
# torch's, not ours. The "catches_*" checks (_battery.py) show that a wrong 1/N (5e2x
# the tolerance at step 0), a skipped micro-batch (5e3x at step 1) and one gradient element
# taking its neighbour's value (6e3x at step 0) still fail this comparison. What Adam's
# per-element normalization hides from any parameter comparison is a gradient element off by
# a constant factor near 1 (10% in one element moved it by 0.15x the tolerance in 4 steps):
# the bucket pack/scale that could cause one is compared bit for bit in tests/ops.


def reference_grads(ref, batch, world_size: int, micro: int,
                    size: int = MICRO_BATCH) -> List[float]:
    """Set ``ref``'s ``.grad`` to the data-parallel average gradient of ``batch`` computed as
    the ranks compute it (see [Note: same-order reference]): micro-batch ``m`` of rank ``r``
    is chunk ``r * micro + m``, its loss divided by ``micro``. Returns each rank's loss (the
    sum of its micro-batch losses), for the loss check."""
    params = [p for p in ref.parameters() if p.requires_grad]
    total = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    losses = []
    for r in range(world_size):
        local = 0.0
        for m in range(micro):
            loss = ref(*chunk(batch, r * micro + m, size)) / micro
            loss.backward()
            local += loss.item()
        losses.append(local)
        for acc, p in zip(total, params):
            if p.grad is not None:
                acc += p.grad
        ref.zero_grad(set_to_none=True)
    for acc, p in zip(total, params):
        p.grad = (acc / world_size).to(p.dtype)
    return losses


def assert_params_close(model, ref, step: int, **tol) -> None:
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().float(), q.detach().float(), **tol,
                                   msg=lambda m, n=n: f"step {step}, {n}: {m}")


# [Note: one step from the same point]
# The same-order reference makes step 0's gradients the same BLAS calls on the same inputs, but
# after step 0 the two models differ by the AdamW round-off (ours against torch's, ~1 ulp), so
# step 1's inputs differ, BLAS rounds the gradients differently, and Adam amplifies that near
# eps (up to lr / (4 eps) = 750x, [Note: same-order reference]). How much depends on which
# kernels BLAS picked, i.e. on the CPU: with MKL's AVX2 kernels (MKL_ENABLE_INSTRUCTIONS=AVX2,
# as an AVX2-only EPYC runs) stage 3's block_called_twice at 4 ranks moved
# blocks.1.proj.weight[8, 26] by 1.41e-6 > atol at step 1 (an AVX2-only CPU failed
# fc_out.weight[28, 125] the same way). That is round-off compounding across steps, not an
# error of ours, and no tolerance bounds it on every CPU. So after each step's comparison the
# reference continues from the ZeRO parameters (its own moments and step count are kept): each
# step compares one update of ours with one update of torch.optim.AdamW from the same point,
# whose difference is bounded by that step's round-off alone. The reference's moments still
# evolve from its own gradients, so a wrong moment, step count or bias correction on our side
# shows as a wrong update at the step it happens; a wrong gradient (scale, missed micro-batch,
# an element from its neighbour) fails at the step it happens, as before (the catches_* checks
# in _battery.py).


def assert_step_close(model, ref, step: int, **tol) -> None:
    """Every parameter of ``model`` (fp32) within ``tol`` of ``ref`` after ``step``, then
    ``ref`` continues from ``model``'s parameters ([Note: one step from the same point]). At
    stage 3 call it inside ``opt.gathered()``."""
    assert_params_close(model, ref, step, **tol)
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref.parameters()):
            q.copy_(p)


def rank_check_tests(checks: Dict[str, Callable], world_size, *, timeout: float = 400.0):
    """``(ranks, test_check)`` for a test module of checks that assert inside the ranks and
    return nothing (or a value to print): each check is a row of :func:`rank_fixture`, so
    ``-k <check>`` spawns that check's ranks only, and a failing rank's traceback (with the
    values its assertion names) is raised in the pytest process. Assign both at module level
    (``ranks, test_check = rank_check_tests(CHECKS, 2)``).

    Args:
        world_size: one world size (tests ``test_check[<check>]``), or a sequence of them
            (``pytest.param`` with marks allowed; tests ``test_check[<world size>-<check>]``).
    """
    import pytest

    single = isinstance(world_size, int)
    ranks = rank_fixture(checks, world_size=world_size if single else None, timeout=timeout)

    def check_at(ranks, row, ws=None):
        for rank, value in enumerate(ranks(row, ws)):
            if value is not None:
                print(f"{row}, rank {rank}: {value}")

    if single:
        @pytest.mark.parametrize("row", list(checks))
        def test_check(ranks, row):
            check_at(ranks, row)
    else:
        @pytest.mark.parametrize("row", list(checks))
        @pytest.mark.parametrize("world_size", list(world_size))
        def test_check(ranks, world_size, row):
            check_at(ranks, row, world_size)

    return ranks, test_check


# -- ranks that return objects ------------------------------------------------------------------

class RankFailure:
    """What a rank sends back for a row whose body raised: the traceback text (picklable, and
    enough to re-raise in the pytest process with the rank's own frames)."""

    def __init__(self, traceback_text: str):
        self.traceback = traceback_text

    def __repr__(self):
        return f"RankFailure({self.traceback.splitlines()[-1]!r})"


class RankError(Exception):
    """A row's body raised on a rank: the message is that rank's traceback."""


def run_rows(rank: int, world_size: int, bodies: Dict[str, Callable], names) -> Dict[str, Any]:
    """Run ``bodies[name](rank, world_size)`` for every name, in order; return name -> its
    return value, or a :class:`RankFailure` with the traceback. A body that fails on one rank
    may leave the others waiting in a collective: the process group's timeout
    (tests/_dist.py) bounds that."""
    torch.manual_seed(0)
    out = {}
    for name in names:
        try:
            out[name] = bodies[name](rank, world_size)
        except Exception:  # noqa: BLE001 - re-raised per row in the pytest process
            out[name] = RankFailure(traceback.format_exc())
    return out


def _selected_rows(request, fixture: str, default_ws: Optional[int]) -> Dict[int, set]:
    """world size -> the rows that the collected (selected) tests of this module ask
    ``fixture`` for: their ``row`` and ``world_size`` parameters."""
    wanted: Dict[int, set] = {}
    for item in request.session.items:
        if getattr(item, "module", None) is not request.module:
            continue
        if fixture not in getattr(item, "fixturenames", ()):
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "row" in params:
            ws = params.get("world_size", default_ws)
            wanted.setdefault(ws, set()).add(params["row"])
    return wanted


def rank_fixture(bodies: Dict[str, Callable], *, world_size: Optional[int] = None,
                 name: str = "ranks", timeout: float = 400.0, pg_timeout_s: float = 60.0):
    """A module-scoped fixture ``name`` for a test module whose tests take a ``row``
    parameter (a key of ``bodies``) and, unless ``world_size`` is given here, a
    ``world_size`` parameter. The fixture is ``get(row, world_size=<default>)`` -> the list,
    by rank, of what ``bodies[row](rank, world_size)`` returned (a picklable object: the test
    asserts on it in the pytest process, so a failure shows the values). A rank whose body
    raised is re-raised here as :class:`RankError` with its traceback.

    One spawn per world size runs the rows of every *selected* test of the module that uses
    the fixture (so ``-k <row>`` runs that row's ranks only; each rank pays a torch import
    once); world size 1 runs here, without torch.distributed, on the ranks' thread count
    (ZKERNELS_TEST_THREADS). Bodies travel to the ranks by pickle: module-level callables or
    ``functools.partial`` of them. Assign at module level: ``ranks = rank_fixture(BODIES, ...)``.
    """
    import pytest

    @pytest.fixture(scope="module", name=name)
    def fixture(request):
        wanted = _selected_rows(request, name, world_size)
        cache: Dict[int, Dict[str, list]] = {}

        def get(row: str, ws: Optional[int] = None) -> list:
            ws = world_size if ws is None else ws
            if ws is None:
                raise TypeError(f"{name}(row, world_size): no default world size")
            if ws not in cache or row not in cache[ws]:
                names = [n for n in bodies if n in wanted.get(ws, set()) | {row}
                         and n not in cache.get(ws, {})]
                if ws == 1:
                    threads = torch.get_num_threads()
                    torch.set_num_threads(rank_threads())
                    try:
                        per_rank = [run_rows(0, 1, bodies, names)]
                    finally:
                        torch.set_num_threads(threads)
                else:
                    per_rank = run_ranks(run_rows, ws, bodies, names, timeout=timeout,
                                         pg_timeout_s=pg_timeout_s)
                done = cache.setdefault(ws, {})
                for n in names:
                    done[n] = [r[n] for r in per_rank]
            results = cache[ws][row]
            for rank, r in enumerate(results):
                if isinstance(r, RankFailure):
                    raise RankError(f"{row} failed on rank {rank} of {ws}:\n{r.traceback}")
            return results

        return get

    return fixture


def ratio(actual, expected, *, rtol: float, atol: float) -> float:
    """The worst ``|actual - expected| / (atol + rtol |expected|)`` over the elements (inf
    where one is NaN and the other not): ``<= 1`` is exactly torch.testing.assert_close's
    pass with these tolerances (equal NaNs aside, which no comparison here expects)."""
    a = torch.as_tensor(actual, dtype=torch.float64)
    e = torch.as_tensor(expected, dtype=torch.float64)
    if a.numel() == 0:
        return 0.0
    err = (a - e).abs() / (atol + rtol * e.abs())
    err = torch.where(torch.isnan(err) | torch.isinf(a) | torch.isinf(e),
                      torch.where(a == e, torch.zeros_like(err), torch.full_like(err, float("inf"))),
                      err)
    return float(err.max())


def worst_param(model, ref, **tol) -> Tuple[float, str]:
    """``(ratio, name)`` of the parameter of ``model`` farthest from ``ref``'s (see
    :func:`ratio`)."""
    out = (0.0, "")
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        r = ratio(p.detach().float(), q.detach().float(), **tol)
        if not r <= out[0]:
            out = (r, n)
    return out


def clone_model(model):
    return copy.deepcopy(model)
