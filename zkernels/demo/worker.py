"""One rank of ``python -m zkernels demo`` (started by ``zkernels.launch.run_ranks``; torchrun
works too).

Trains the small GPT on every rung (data parallel = DDP + torch.optim.AdamW, then
``ZeroOptimizer`` stage 1, 2, 3 and the offload rungs: see ``rungs.py``) from the same seed on
the same batches, and measures the loss, step time, bytes sent per step and bytes held per kind
on the device, in host RAM and on disk, beside ``estimate_memory``'s estimate of each (taken
from the model before the rung's optimizer reshapes it). The rungs take their steps in
turn (step i of every rung, then step i + 1, the order rotated each step), so that a change in
the machine's load lands on every rung alike; each rung's step time is also given as the
median of its per-step ratios to data parallel's (paired). With ``--eval-batches N``, each
rung's model is then scored on N fixed batches (:func:`eval_loss`; [Note: the demo's evaluation
batches] in data.py). Rank 0 writes the results as JSON to ``--out`` for the launcher to print.

[Note: measuring data parallel]
DDP runs with ``gradient_as_bucket_view=True``: its buckets are the gradients, so a rank holds
params + grads + AdamW states (+ nothing else model-sized). Bytes sent are counted by a comm
hook from each bucket's size, ring convention (an all-reduce of B bytes sends 2·B·(N−1)/N),
the convention ``ZeroOptimizer.stats()`` uses for its reduce-scatters and all-gathers.

[Note: the demo's build peak]
The ZeRO rungs are built as a model that does not fit would be: the GPT on the meta device,
``ZeroOptimizer(..., device=, param_init=None)`` materializing it unit by unit, then
``zk.checkpoint.load_pretrained`` of the seed's initial weights, which rank 0 wrote once to
``init.safetensors`` in ``--out`` (so every rung starts from the same values as data
parallel, which builds ``GPT(cfg)`` whole and wraps it in DDP). The "build" column is the
peak of tensor bytes a rank allocated while doing so (``zkernels.bench.peak_tensors``:
torch's allocators, every device; [Note: tracked tensor bytes] there), beside the estimate:
the larger of ``estimate_phases``' build and load peaks (the file pages included: the tensors
safetensors hands out for the rows read are counted by the profiler and stay allocated until
the file is closed, which the demo's one fp32 file is at the end of the load);
for data parallel the model, DDP's gradient buckets and the buffer DDP's construction
broadcasts rank 0's parameters through (coalesced, up to pΨ; whether it is freed before the
buckets are allocated varies from run to run, so data parallel's figure is an upper bound:
measured between params + grads and this).

[Note: the demo's NVMe budget]
The NVMe rung caps its host RAM at ``OffloadConfig(nvme_buffer_bytes=2 MiB)`` instead of the
default 64 MiB (NVMe offload sizes its arena to the largest unit's shard, capped by the
budget): the point is that host RAM holds a bounded budget smaller than the states on disk. The estimate is given the same budget. Its files go in ``--offload-dir``
(default: a folder inside the launcher's temporary folder, removed with it; each run's files
are also removed by ``ZeroOptimizer.close()`` at the end).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..bench.peak_tensors import TensorPeak
from ..launch import failure_recorded, init_method
from ..zero.planning.estimate import estimate_memory
from ..zero.planning.phases import estimate_phases
from ..zero.stats import KINDS
from .data import VOCAB_SIZE, get_batch, load_corpus
from .model import GPT, GPTConfig
from .progress import progress
from .rungs import DEFAULT_RUNGS, Rung, parse_rungs

NVME_BUFFER_BYTES = 2 * 2**20   # see [Note: the demo's NVMe budget]


def _bucket_bytes(text: str):
    """``--bucket-bytes``: "auto" (None: each method's own default) or a number of bytes."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number of bytes, got "
                                         f"{text!r}") from None


# Demo defaults: 60 steps of each of the 7 default rungs, about 75 s of CPU in all (about a
# minute on the 2-core machine when nothing else runs); tests pass tiny ones.
WORKER_OPTS = [("--rungs", str, DEFAULT_RUNGS,
                "comma list of rungs, as plan names them ('stage 2 + cpu offload') or by key: "
                "ddp (DDP + AdamW), 1, 2, 3, 2+cpu, 3+cpu, 3+cpu+params, 2+nvme, 3+nvme, "
                "3+nvme+params"),
               ("--steps", int, 60, "training steps per rung (K)"),
               ("--n-layer", int, 4, "GPT layers"), ("--n-head", int, 2, "attention heads"),
               ("--n-embd", int, 128, "width"), ("--block-size", int, 64, "context length"),
               ("--batch-size", int, 8, "sequences per rank per step"),
               ("--lr", float, 1e-3, "AdamW learning rate"),
               ("--weight-decay", float, 0.1, "AdamW weight decay"),
               # auto: ZeroOptimizer sizes its buckets from the model (see [Note: buckets sized
               # from the model] in zkernels/zero/planning/buckets.py), DDP takes its own default.
               ("--bucket-bytes", _bucket_bytes, "auto",
                "gradient bucket size in bytes (DDP and ZeRO), or auto"),
               ("--seed", int, 0, "seed of the init and of the batches"),
               ("--eval-batches", int, 0, "after the last step, score each rung's model on "
                                          "this many fixed batches drawn apart from the "
                                          "training ones (the eval loss; 0: none)"),
               ("--param-dtype", str, "fp32", "compute dtype of the ZeRO rungs, fp32 or bf16 "
                                              "(bf16: fp32 master and gradient reduction; "
                                              "data parallel stays fp32)"),
               ("--state-dtype", str, "fp32", "the ZeRO rungs' AdamW moments: fp32, bf16 or "
                                              "int8 (blockwise, an fp32 scale per 256)"),
               ("--master-dtype", str, "fp32", "the ZeRO rungs' AdamW master: fp32 or bf16 "
                                               "(needs --param-dtype bf16)"),
               ("--state-block-size", int, 256, "int8 state: elements per fp32 scale (a "
                                                 "power of two)"),
               ("--ckpt-dir", str, "", "save each ZeRO rung's final state here, a "
                                       "zkernels.checkpoint per rung (stage1, stage2, "
                                       "stage2-cpu, ...)"),
               ("--offload-dir", str, "", "folder for the nvme rungs' files (default: a "
                                          "temporary folder, removed after)")]


PARAM_DTYPES = {"fp32": None, "bf16": torch.bfloat16}
STATE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "int8": "int8"}


def _tensor_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if t is not None:
            seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


class _SentBytes:
    """The comm hook's state: bytes sent this step. It holds nothing else, so DDP's reducer
    (which keeps the hook and its state) and this rung form no reference cycle, and the DDP
    wrapper, which holds the process group, is freed with the rung (see [Note: process group
    teardown] in zkernels/comm/select.py)."""

    def __init__(self, world_size: int):
        self.world_size, self.total = world_size, 0


def _counting_allreduce_hook(state: _SentBytes, bucket):
    buf = bucket.buffer()
    n = state.world_size
    state.total += 2 * buf.numel() * buf.element_size() * (n - 1) // n
    buf.div_(n)
    fut = dist.all_reduce(buf, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


class _DDPRung:
    """DDP + torch.optim.AdamW with a byte-counting comm hook (see [Note: measuring data
    parallel])."""

    def __init__(self, model, args, device):
        from torch.nn.parallel import DistributedDataParallel as DDP
        cap = {} if args.bucket_bytes is None else {"bucket_cap_mb": args.bucket_bytes / 2**20}
        self.model = DDP(model, device_ids=[device] if device.type == "cuda" else None,
                         gradient_as_bucket_view=True, **cap)
        self.opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                     eps=1e-8, weight_decay=args.weight_decay)
        self.sent = _SentBytes(dist.get_world_size())
        self.model.register_comm_hook(self.sent, _counting_allreduce_hook)

    def step(self, x, y):
        self.sent.total = 0
        loss = self.model(x, y)
        loss.backward()
        self.opt.step()
        stats = self.stats()
        self.opt.zero_grad(set_to_none=False)   # keep the grads: they are the buckets
        return loss, stats

    def stats(self):
        params = list(self.model.module.parameters())
        states = [t for st in self.opt.state.values() for t in st.values()
                  if torch.is_tensor(t) and t.dim() > 0]
        mem = dict(params=_tensor_bytes(params), grads=_tensor_bytes(p.grad for p in params),
                   master=0, optimizer_states=_tensor_bytes(states), buffers=0)
        mem["total"] = sum(mem.values())
        nothing = dict.fromkeys(list(KINDS) + ["total"], 0)
        return {"comm_bytes": {"total": self.sent.total}, "memory_bytes": mem,
                "memory_bytes_by_location": {"device": mem, "host": nothing,
                                             "disk": dict(nothing)},
                "offload": None}

    def full_params(self):
        return [p.detach().float().reshape(-1).cpu() for p in self.model.module.parameters()]

    def close(self):
        pass


class _ZeroRung:
    """``ZeroOptimizer`` at ``rung``'s stage and offload (NVMe: files under ``offload_dir``,
    through :data:`NVME_BUFFER_BYTES` of host RAM, see [Note: the demo's NVMe budget])."""

    def __init__(self, model, args, rung: Rung, offload_dir: str, device=None):
        try:
            from zkernels import ZeroOptimizer
            from zkernels.zero.planning.offload_config import OffloadConfig
        except ImportError as exc:
            raise RuntimeError("this zkernels has no ZeroOptimizer: run the demo with "
                               "--rungs ddp") from exc
        self.model = model
        nvme = rung.offload == "nvme"
        self.opt = ZeroOptimizer(
            model, stage=rung.stage, lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
            weight_decay=args.weight_decay, bucket_bytes=args.bucket_bytes,
            offload=rung.offload, offload_params=rung.offload_params,
            offload_dir=offload_dir if nvme else None,
            offload_config=OffloadConfig(nvme_buffer_bytes=NVME_BUFFER_BYTES) if nvme else None,
            param_dtype=PARAM_DTYPES[args.param_dtype],
            quantize_weights=rung.quantize_weights, quantize_grads=rung.quantize_grads,
            state_dtype=STATE_DTYPES[args.state_dtype], state_block_size=args.state_block_size,
            master_dtype=PARAM_DTYPES[args.master_dtype],
            **({} if device is None else dict(device=device, param_init=None)))

    def step(self, x, y):
        loss = self.model(x, y)
        self.opt.backward(loss)
        self.opt.step()
        stats = self.opt.stats()
        self.opt.zero_grad()
        return loss, stats

    def full_params(self):
        """Every parameter, full (stage 3 gathers them: collective, every rank calls it)."""
        with self.opt.gathered():    # copies: the gathered storage is freed on exit
            return [p.detach().float().reshape(-1).cpu().clone()
                    for p in self.model.parameters()]

    def close(self):
        self.opt.close()    # the NVMe rung's files and folder go now


def checkpoint_path(args, rung: Rung) -> str:
    return os.path.join(args.ckpt_dir, "stage" + rung.key.replace("+", "-"))


def model_config(args) -> GPTConfig:
    """The demo GPT's sizes from the command line."""
    return GPTConfig(vocab_size=VOCAB_SIZE, block_size=args.block_size, n_layer=args.n_layer,
                     n_head=args.n_head, n_embd=args.n_embd)


def _estimate(model, rung: Rung, world_size: int, args) -> dict:
    """``estimate_memory`` for ``rung`` by kind and by place, keyed as ``stats()`` keys its
    measurements: between steps (no transient; reduce buffers only where they are held between
    steps, not stage 3's), the host's staging and bounces counted as buffers."""
    zero = rung.stage != 0
    kw = dict(offload=rung.offload, offload_params=rung.offload_params,
              bucket_bytes=args.bucket_bytes, nvme_buffer_bytes=NVME_BUFFER_BYTES,
              param_dtype=PARAM_DTYPES[args.param_dtype] if zero else None,
              quantize_weights=rung.quantize_weights, quantize_grads=rung.quantize_grads,
              state_dtype=STATE_DTYPES[args.state_dtype] if zero else None,
              state_block_size=args.state_block_size,
              master_dtype=PARAM_DTYPES[args.master_dtype] if zero else None)
    est = estimate_memory(model, world_size, rung.stage, **kw)
    where = {}
    for place, kinds in est.by_location.items():
        kinds = dict(kinds)
        kinds.pop("transient", None)
        if place == "device":  # reduce buffers live on the device
            kinds["buffers"] = est.held_buffers_bytes
        kinds["buffers"] = kinds.get("buffers", 0) + kinds.pop("staging", 0) + \
            kinds.pop("bounces", 0)   # NVMe's slots, and its parameter files' bounces
        where[place] = {k: int(kinds.get(k, 0)) for k in KINDS}
        where[place]["total"] = sum(where[place][k] for k in KINDS)
    return dict(params=est.params_bytes, grads=est.grads_bytes, master=est.master_bytes,
                optimizer_states=est.optimizer_states_bytes, buffers=est.held_buffers_bytes,
                total=est.held_device_bytes, peak=est.device_bytes,
                transient=est.transient_bytes, host=est.host_bytes,
                disk=est.disk_bytes, comm_bytes=est.comm_bytes,
                host_device_bytes=est.host_device_bytes, by_location=where,
                num_params=est.num_params, build_peak=_build_estimate(model, rung,
                                                                      world_size, est, kw))


def _build_estimate(model, rung: Rung, world_size: int, est, kw) -> int:
    """Tensor bytes at the build's peak (see [Note: the demo's build peak])."""
    if rung.stage == 0:   # the model, DDP's buckets, and its initial broadcast's buffer
        return 2 * est.params_bytes + est.grads_bytes
    ph = estimate_phases(model, world_size, rung.stage, file_dtype=torch.float32, **kw)
    return max(ph.peak_bytes("build"), ph.peak_bytes("load"))


def write_initial_weights(args, rank: int) -> str:
    """Rank 0 writes the seed's initial GPT to ``--out``/init.safetensors (tied tensors once);
    every rank returns its path once it exists (collective)."""
    path = os.path.join(args.out, "init.safetensors")
    if rank == 0:
        from safetensors.torch import save_file
        torch.manual_seed(args.seed)
        tensors, seen = {}, set()
        for k, t in GPT(model_config(args)).state_dict().items():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                tensors[k] = t.contiguous()
        save_file(tensors, path)
    dist.barrier()
    return path


def _build_rung(rung: Rung, args, device, world_size: int, offload_dir: str, init_path: str):
    """The rung's model (same initial weights), trainer and estimate (taken from the model's
    shapes before it is built), and the peak of tensor bytes while building (see [Note: the
    demo's build peak])."""
    with torch.device("meta"):
        shapes = GPT(model_config(args))
    est = _estimate(shapes, rung, world_size, args)
    from .. import checkpoint
    with TensorPeak() as peak:
        if rung.stage == 0:
            torch.manual_seed(args.seed)
            model = GPT(model_config(args)).to(device)
            trainer = _DDPRung(model, args, device)
        else:
            model = shapes
            trainer = _ZeroRung(model, args, rung, offload_dir, device=device)
            checkpoint.load_pretrained(trainer.opt, init_path)
    est["build_peak_measured"] = peak.peak_bytes
    return model, trainer, est


def eval_batches(tokens, args, device, rank: int, world_size: int) -> list:
    """This rank's slices of the ``--eval-batches`` fixed evaluation batches (see [Note: the
    demo's evaluation batches] in data.py), the same for every rung."""
    return [tuple(t.to(device) for t in get_batch(
        tokens, seed=args.seed, step=i, rank=rank, world_size=world_size,
        batch_size=args.batch_size, block_size=args.block_size, stream="eval"))
        for i in range(args.eval_batches)]


@torch.no_grad()
def eval_loss(model, batches, world_size: int) -> float:
    """The mean loss of ``model`` over ``batches`` (every rank its own slices; the mean over
    ranks, all-reduced): the parameters as the last step left them, through the model's usual
    forward (stage 3 gathers each unit and frees it after, as in training; with int8 weights
    the gather is the quantized one). Collective: every rank calls it with as many batches."""
    was_training = model.training
    model.eval()
    try:
        total = torch.zeros(1, dtype=torch.float64, device=batches[0][0].device)
        for x, y in batches:
            total += model(x, y).double()
    finally:
        model.train(was_training)
    dist.all_reduce(total)
    return total.item() / (world_size * len(batches))


def run_rungs(rungs, args, tokens, device, rank: int, world_size: int, offload_dir: str):
    """Train ``args.steps`` steps on every rung, in turn step by step; returns this rank's
    measurements and final parameters per rung, in ``rungs`` order. With ``--resume``, each
    (ZeRO) rung first loads its checkpoint from ``--ckpt-dir`` (saved at any world size) and
    continues from its step; with ``--ckpt-dir``, each saves there at the end."""
    built = []
    init_path = write_initial_weights(args, rank)
    try:
        for r in rungs:
            built.append(_build_rung(r, args, device, world_size, offload_dir, init_path))
        return _train(rungs, built, args, tokens, device, rank, world_size)
    finally:
        for _model, trainer, _est in built:
            trainer.close()


def _train(rungs, built, args, tokens, device, rank: int, world_size: int):
    """:func:`run_rungs`' loop over the built ``(model, trainer, estimate)`` triples."""
    starts = [0] * len(rungs)
    if args.resume:
        from .. import checkpoint
        starts = [checkpoint.load(trainer.opt, checkpoint_path(args, r))["step"]
                  for r, (_model, trainer, _est) in zip(rungs, built)]
    losses = [[] for _ in rungs]
    times = [[] for _ in rungs]
    stats = [None] * len(rungs)
    bar = progress(args.steps, f"{len(rungs)} rung{'s' * (len(rungs) != 1)}",
                   enabled=rank == 0)
    for step in range(args.steps):
        shift = step % len(rungs)
        for i in list(range(len(rungs)))[shift:] + list(range(len(rungs)))[:shift]:
            x, y = (t.to(device) for t in get_batch(
                tokens, seed=args.seed, step=starts[i] + step, rank=rank,
                world_size=world_size, batch_size=args.batch_size,
                block_size=args.block_size))
            trainer = built[i][1]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()      # every rank starts the step together (as in the benchmark)
            t0 = time.perf_counter()
            loss, stats[i] = trainer.step(x, y)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[i].append(time.perf_counter() - t0)
            losses[i].append(loss.detach().float().reshape(1))
        # Rank 0's own loss of the first rung (the table's are the mean over ranks), named so.
        bar.update(1, rank0_loss=losses[0][-1].item())
    bar.close()
    # The global batch's loss, as one process would see it: the mean over ranks, summed (in
    # fp32) by one all-reduce after training instead of one per rung and step.
    total = torch.stack([torch.cat(x) for x in losses])
    dist.all_reduce(total)
    losses = [[v / world_size for v in row] for row in total.tolist()]
    evals = [None] * len(rungs)
    if args.eval_batches:
        batches = eval_batches(tokens, args, device, rank, world_size)
        evals = [eval_loss(model, batches, world_size) for model, _trainer, _est in built]
    if args.ckpt_dir:
        from .. import checkpoint
        for i, rung in enumerate(rungs):
            if rung.stage != 0:
                checkpoint.save(built[i][1].opt, checkpoint_path(args, rung),
                                model_extra={"step": starts[i] + args.steps})
    # The slowest rank's time per step, and each rung's per-step ratio to the first rung's.
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    times = slowest.tolist()
    skip = 1 if args.steps > 1 else 0   # the first step pays one-off allocations
    out = []
    for i, rung in enumerate(rungs):
        _model, trainer, est = built[i]
        params = torch.cat(trainer.full_params())
        paired = statistics.median(t / b for t, b in zip(times[i][skip:], times[0][skip:]))
        st = stats[i]
        offload = {k: v for k, v in (st.get("offload") or {}).items()
                   if k.endswith("_bytes")} or None     # this step's copies and disk I/O
        out.append((dict(
            rung=rung.key, name=rung.name, short=rung.short, stage=rung.stage,
            offload=rung.offload, offload_params=rung.offload_params,
            quantize_weights=rung.quantize_weights, quantize_grads=rung.quantize_grads,
            state_dtype=args.state_dtype if rung.stage else "fp32",
            first_step=starts[i], losses=losses[i], final_loss=losses[i][-1],
            eval_loss=evals[i], eval_batches=args.eval_batches,
            step_time_s=statistics.median(times[i][skip:]), step_times_s=times[i][skip:],
            step_time_ratio_paired=paired, ratio_to=rungs[0].name,
            comm_bytes=int(st["comm_bytes"]["total"]),
            memory_bytes=st["memory_bytes"],
            memory_bytes_by_location=st["memory_bytes_by_location"],
            offload_bytes=offload, estimate=est, num_params=est["num_params"],
            build_peak_bytes=est.pop("build_peak_measured")), params))
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="zkernels.demo.worker")
    for flag, typ, default, doc in WORKER_OPTS:
        ap.add_argument(flag, type=typ, default=default, help=doc)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--resume", action="store_true", help="ZeRO rungs start from --ckpt-dir")
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--out", required=True, help="folder for rank 0's results.json")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)    # ranks share the machine's cores
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=init_method(), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.timeout_s))
    try:
        with failure_recorded():    # stamped before the teardown below releases the peers
            _run(args, device, rank, world_size)
    finally:
        # Nothing may hold the group when it is destroyed, or its gloo threads live into
        # interpreter teardown ([Note: process group teardown] in zkernels/comm/select.py):
        # the rungs' DDP wrappers and optimizers are gone by now, cycles included.
        gc.collect()
        dist.destroy_process_group()
    return 0


def _run(args, device, rank: int, world_size: int) -> None:
    """:func:`main` in the process group: every rung, and rank 0 writes the results."""
    tokens = load_corpus()
    results, reference = [], None
    rungs = parse_rungs(args.rungs)
    offload_dir = args.offload_dir or os.path.join(args.out, "nvme")
    for res, params in run_rungs(rungs, args, tokens, device, rank, world_size,
                                 offload_dir):
        # Every rung ends with full parameters on every rank: compare with the first.
        reference = params if reference is None else reference
        res["max_param_diff"] = (params - reference).abs().max().item()
        results.append(res)
    if rank == 0:
        meta = dict(world_size=world_size, device=str(device), torch=torch.__version__,
                    args=vars(args))
        tmp = os.path.join(args.out, "results.json.tmp")
        with open(tmp, "w") as f:
            json.dump(dict(meta=meta, rungs=results), f)
        os.replace(tmp, os.path.join(args.out, "results.json"))
    dist.barrier()


if __name__ == "__main__":
    sys.exit(main())
