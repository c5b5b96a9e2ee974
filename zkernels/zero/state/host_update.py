"""``offload="cpu"``: fp32 master and AdamW moments in host RAM, the step on the CPU.

[Note: CPU offload step]
Three overlaps make the offloaded step cheap (ZeRO-Offload's schedule, with our fused C++ AdamW):

1. During backward, each bucket's reduced gradient shard is copied to a host fp32 shard the
   moment its reduce-scatter finishes (:class:`HostGradShards` is the stage-2 reducer's grad
   sink: ``on_reduced`` issues the copy off the compute stream and hands its fence to the
   reduce pool, which waits it before reusing the buffer). Only the copies still running when
   backward ends are exposed: ``stats()["offload"]`` reports copy time and the part hidden.
2. The step runs the native CPU AdamW (``zkernels._C``, the reference where it is not built)
   over host buffers in sub-groups of ``OffloadConfig.sub_group_numel`` elements, reading the
   fp32 gradient and writing the updated parameters in the compute dtype in the same pass
   (no separate cast, no fp32 copy to ship).
3. The compute-dtype result of sub-group k goes to the device (into the unit's compute
   shard) on the copy stream while sub-group k+1 updates; two host staging buffers alternate,
   and a buffer is reused only after its copy finished. In pure fp32 the master itself is
   copied (no staging). The unit's last copy is fenced onto the compute stream before the
   gather policy's ``publish`` (stage 2: the all-gather) reads the shard.

Host memory per rank: master 4Ψ/N + moments 8Ψ/N + gradient shard 4Ψ/N + two staging
sub-groups; on the device only the compute parameters and the reduce buffers remain.
Stage 1 is refused (its full gradients live on the device until ``step()``: nothing to stream
during backward, and the registry's ``min_stage`` is 2).

Stage 3 plugs in unchanged: its units get their states from the same ``init_state`` (the
optimizer passes its update strategy to the unit builder), its gradient strategy is stage 2's
reducer over units (so it takes the same ``grad_sink``), and ``update`` writes the persistent
compute shard of a sharded unit exactly as it writes a replicated unit's slice. With
``offload_params=True`` (stage 3) the strategy also places the *parameter* shards: its
``sharded_params`` gives each unit a gather policy whose shard lives in host RAM and comes to
the device ahead of the unit's all-gather (``param_offload.py``, [Note: parameter offload]);
the update then writes the host shard directly (no staging, nothing sent in ``step()``), and
in pure fp32 the master is the shard itself.
"""
from __future__ import annotations

import time
import weakref
from typing import Dict, List, Optional

import torch

from ...ops import OpSet
from ..planning.offload_config import OffloadConfig
from ..parameters.param_offload import HostParamStore
from .shard_state import ShardState
from .transfer import Copier, Fence
from ..parameters.units import FlatParamUnit, ShardedParams
from .update import GradScale


class HostGradShards:
    """Stage 2's grad sink under CPU offload: one host fp32 shard per unit, filled by copies
    issued as each reduce-scatter finishes (see [Note: CPU offload step])."""

    on_device = False

    def __init__(self, copier: Copier) -> None:
        self._copier = copier
        self.shards: List[torch.Tensor] = []
        self._filled: List[bool] = []
        self._fences: List[Optional[Fence]] = []
        self.exposed_s = 0.0  # host time spent waiting for copies in collect() (not hidden)

    def add(self, numel: int) -> None:
        self.shards.append(self._copier.host_empty(numel, torch.float32))
        self._filled.append(False)
        self._fences.append(None)

    def accumulate(self, bucket: int, reduced: torch.Tensor) -> Optional[Fence]:
        if not self._filled[bucket]:
            self._filled[bucket] = True
            self._fences[bucket] = self._copier.to_host(self.shards[bucket], reduced)
            return self._fences[bucket]
        # A second synced backward without zero_grad: add on the host (rare; blocking).
        self._sync(bucket)
        tmp = self._copier.host_empty(reduced.numel(), torch.float32)
        self._copier.to_host(tmp, reduced).synchronize()
        self.shards[bucket].add_(tmp)
        return None

    def _sync(self, bucket: int) -> None:
        f = self._fences[bucket]
        if f is not None:
            f.synchronize()
            self._fences[bucket] = None

    def collect(self) -> List[torch.Tensor]:
        t0 = time.perf_counter()
        for bi in range(len(self.shards)):
            self._sync(bi)
        self.exposed_s += time.perf_counter() - t0
        for bi, filled in enumerate(self._filled):
            if not filled:
                self.shards[bi].zero_()
        return self.shards

    def reset(self) -> None:
        for bi in range(len(self.shards)):
            self._sync(bi)
        self._filled = [False] * len(self.shards)


def host_scalar(grad_scale: GradScale) -> Optional[float]:
    """``grad_scale`` as a host number (a device tensor is read once: one sync per step)."""
    if isinstance(grad_scale, torch.Tensor):
        return float(grad_scale.item())
    return grad_scale


class HostUpdate:
    """Update strategy of ``offload="cpu"`` (see [Note: CPU offload step]).

    Args:
        host_ops: an OpSet for CPU tensors (the native AdamW where built).
        device: the compute device (CPU here, where the "device" buffers are separate from
            the host ones; CUDA on GPU machines).
        config: the :class:`OffloadConfig`.
        offload_params: stage 3: keep the parameter shards in host RAM too (see
            [Note: parameter offload]).

    Attributes:
        placement: "cpu".
        param_store: the :class:`~zkernels.zero.parameters.param_offload.HostParamStore` (None without
            ``offload_params``).
        states: one :class:`ShardState` per unit, its tensors in host RAM.
        grad_sink: the :class:`HostGradShards` the stage-2 reducer fills.
        grad_ops: the OpSet for the gradient shards (clipping's sum of squares).
    """

    placement = "cpu"
    resumed = False

    def __init__(self, host_ops: OpSet, device: torch.device, config: OffloadConfig,
                 offload_params: bool = False) -> None:
        self.host_ops = self.grad_ops = host_ops
        self.config = config
        self.copier = Copier(device, config.pin_memory)
        self.param_store = HostParamStore(self.copier) if offload_params else None
        self.states: List[ShardState] = []
        self.grad_sink = HostGradShards(self.copier)
        self._staging: List[torch.Tensor] = []
        self._staging_fences: List[Optional[Fence]] = [None, None]
        self._slot = 0
        self._update_s = 0.0
        self._h2d_exposed_s = 0.0
        self.last_step: Dict[str, float] = {}
        self._finalizer = weakref.finalize(self, Copier.close, self.copier)

    def init_state(self, unit: FlatParamUnit, initial_master: torch.Tensor) -> ShardState:
        """Host master (the fp32 shard values), zero moments, a host gradient shard."""
        if unit.index != len(self.states):
            raise ValueError(f"init_state: unit {unit.index} out of order (expected "
                             f"{len(self.states)})")
        n = unit.layout.shard_numel
        on_host = unit.gather.shard_on_host
        if on_host and unit.compute_dtype == torch.float32:
            master = unit.compute_shard   # the host parameter shard is its own master
        else:
            master = self.copier.host_empty(n, torch.float32)
            master.copy_(initial_master)
        m = self.copier.host_empty(n, torch.float32).zero_()
        v = self.copier.host_empty(n, torch.float32).zero_()
        self.grad_sink.add(n)
        if unit.compute_dtype != torch.float32 and not on_host:
            need = min(n, self.config.sub_group_numel)
            if not self._staging or self._staging[0].numel() < need \
                    or self._staging[0].dtype != unit.compute_dtype:
                self._staging = [self.copier.host_empty(need, unit.compute_dtype)
                                 for _ in range(2)]
        state = ShardState(unit.index, unit.names, unit.layout, unit.rank, master, m, v)
        self.states.append(state)
        return state

    def update(self, unit: FlatParamUnit, grad: torch.Tensor, group: dict,
               grad_scale: GradScale) -> None:
        """One AdamW step on the host, sub-group by sub-group; each sub-group's updated
        compute params go to the device while the next one updates.

        Args:
            grad: [shard_numel] fp32 host gradient shard (this strategy's ``grad_sink``).
        """
        t0 = time.perf_counter()
        st = self.states[unit.index]
        beta1, beta2 = group["betas"]
        st.step += 1
        scale = host_scalar(grad_scale)
        mixed = unit.compute_dtype != torch.float32
        n, sub = unit.layout.shard_numel, self.config.sub_group_numel
        last: Optional[Fence] = None
        if unit.gather.shard_on_host:
            # [Note: parameter offload]: write the host shard in place, nothing to send.
            self.param_store.settle()
            for lo in range(0, n, sub):
                hi = min(n, lo + sub)
                self.host_ops.adamw_step(
                    st.master[lo:hi], grad[lo:hi], st.exp_avg[lo:hi], st.exp_avg_sq[lo:hi],
                    lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                    eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                    step=st.step, grad_scale=scale,
                    out=unit.compute_shard[lo:hi] if mixed else None)
            self._update_s += time.perf_counter() - t0
            return
        for lo in range(0, n, sub):
            hi = min(n, lo + sub)
            out = None
            if mixed:
                slot = self._slot
                self._slot ^= 1
                self._wait_staging(slot)
                out = self._staging[slot][:hi - lo]
            self.host_ops.adamw_step(
                st.master[lo:hi], grad[lo:hi], st.exp_avg[lo:hi], st.exp_avg_sq[lo:hi],
                lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                step=st.step, grad_scale=scale, out=out)
            last = self.copier.to_device(unit.compute_shard[lo:hi],
                                         out if mixed else st.master[lo:hi])
            if mixed:
                self._staging_fences[slot] = last
        if last is not None:
            last.wait()  # the gather (publish) reads the compute shard after the copy
        self._update_s += time.perf_counter() - t0

    def _wait_staging(self, slot: int) -> None:
        f = self._staging_fences[slot]
        if f is not None:
            t0 = time.perf_counter()
            f.synchronize()
            self._h2d_exposed_s += time.perf_counter() - t0
            self._staging_fences[slot] = None

    def finish_step(self) -> None:
        """Every copy of the step is done (the host master may change again); record the
        step's transfer figures in :attr:`last_step`."""
        t0 = time.perf_counter()
        c = self.copier.take_counters()
        params = self.param_store.take_counters() if self.param_store is not None else {}
        tail = time.perf_counter() - t0
        self._h2d_exposed_s += tail
        self._staging_fences = [None, None]
        d2h_exposed = self.grad_sink.exposed_s
        self.last_step = {
            "update_s": self._update_s + tail,
            "host_to_device_bytes": c["to_device_bytes"],
            "device_to_host_bytes": c["to_host_bytes"],
            "device_to_host_s": c["to_host_busy_s"],
            "device_to_host_exposed_s": min(d2h_exposed, c["to_host_busy_s"]),
            "device_to_host_hidden_s": max(0.0, c["to_host_busy_s"] - d2h_exposed),
            "host_to_device_s": c["to_device_busy_s"],
            "host_to_device_exposed_s": self._h2d_exposed_s,
            "disk_read_bytes": 0, "disk_write_bytes": 0, **params,
        }
        self._update_s = self._h2d_exposed_s = 0.0
        self.grad_sink.exposed_s = 0.0

    def load_state(self, unit: FlatParamUnit, step: int, master: torch.Tensor,
                   exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Overwrite ``unit``'s host state and its device compute shard."""
        st = self.states[unit.index]
        st.step = int(step)
        st.exp_avg.copy_(exp_avg)
        st.exp_avg_sq.copy_(exp_avg_sq)
        st.master.copy_(master)
        if unit.gather.shard_on_host:
            self.param_store.settle()
            if unit.compute_dtype != torch.float32:
                self.host_ops.cast(st.master, out=unit.compute_shard)
            return   # fp32: the master is the shard
        src = st.master if unit.compute_dtype == torch.float32 else \
            self.host_ops.cast(st.master, unit.compute_dtype)
        self.copier.to_device(unit.compute_shard, src).synchronize()

    def state_tensors(self, unit_index: int):
        """``(master, exp_avg, exp_avg_sq)`` of a unit (the live host tensors)."""
        return self.states[unit_index].tensors()

    def held(self) -> Dict[str, List[torch.Tensor]]:
        """Device tensors held by kind: none (everything this strategy holds is on the
        host)."""
        return {"master": [], "optimizer_states": []}

    def held_host(self) -> Dict[str, List[torch.Tensor]]:
        """Host tensors held by kind (for ``stats()``)."""
        return {"params": self.param_store.held_host() if self.param_store is not None else [],
                "master": [s.master for s in self.states],
                "optimizer_states": [t for s in self.states for t in (s.exp_avg, s.exp_avg_sq)],
                "grads": list(self.grad_sink.shards), "buffers": list(self._staging)}

    def disk_bytes(self) -> Dict[str, int]:
        return {}

    def sharded_params(self, params, layout, rank: int, compute_shard: torch.Tensor):
        """Stage 3's gather policy: the shard in host RAM with ``offload_params`` (see
        [Note: parameter offload]), else on the device."""
        if self.param_store is None:
            return ShardedParams(params, layout, compute_shard)
        return self.param_store.sharded_params(params, layout, rank, compute_shard)

    def close(self) -> None:
        """Finish copies and stop the copy thread (idempotent)."""
        self._finalizer()

    def adopt(self, num_units: int) -> None:
        raise RuntimeError(f"{type(self).__name__} does not resume kept state")
