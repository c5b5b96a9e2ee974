"""Hybrid sharding: shard within groups of K ranks, replicate across the N/K groups (FSDP2's
HSDP, a 2-D ``DeviceMesh`` of replicate x shard).

[Note: hybrid sharding is a group shape]
Every rung shards over its group of K consecutive ranks exactly as it would over a world of
K: :class:`HybridComm` presents the shard group as the comm (``rank`` is the rank within the
group, ``world_size`` is K), so layouts, units, stage-3 gathers, the path checks, the
gradient norm and the update see K ranks and nothing else changes. The one addition is on
the gradient side: each reduce-scatter (within the group) is followed by an all-reduce (sum)
of the reduced shard across the N/K groups, over the replicate group of this rank's position
(ranks r, r + K, r + 2K, ...). So after ``wait()`` every replica holds the same shard, summed
over all N ranks, and each rank sends 2 x shard x (G-1)/G bytes across groups per bucket (the
meter's ring convention, G = N/K): 2Ψ/K elements per step, whatever the stage. The gradient
average is over all N ranks: the gradient strategies pre-divide by :func:`num_averaged`
(N), not by the group's K.

The cross-group all-reduce is launched as soon as the reduce-scatter is seen complete, not
at ``wait()``: whenever this comm is next used for any collective (the next bucket's
reduce-scatter, a stage-3 gather) and finds it done (``Handle.done()``: gloo's work, or the
CUDA event, queried without blocking), at the latest in ``wait()``. Launching it at once would
make the compute stream (on CUDA) or the host (gloo, whose reduce-scatter is summed in
``wait()``) wait for the reduce-scatter in the middle of backward. Launches follow
reduce-scatter order, so every replica issues the same all-reduces in the same order.

Because the shards are identical across replicas after the all-reduce, everything computed
from them agrees across all N ranks with collectives inside the group only: the sum of
squares of the gradient norm (each group holds the model once: summing within the group
counts every element once, and replicas are not double counted) and the non-finite flag (an
inf or NaN on any rank reaches every replica's shard through the all-reduce).
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Deque, Optional, Tuple

import torch

from .base import Comm, Handle


def num_averaged(comm: Comm) -> int:
    """The ranks a gradient is averaged over: the data-parallel world (N), which for a
    :class:`HybridComm` is more than its shard group's ``world_size`` (K)."""
    return getattr(comm, "data_parallel_size", comm.world_size)


class _AcrossGroups:
    """Handle of a reduce-scatter within the group followed by the all-reduce of its shard
    across groups (see [Note: hybrid sharding is a group shape])."""

    def __init__(self, within: Handle, output: torch.Tensor, across: Comm,
                 average: bool, tag: Optional[str],
                 launch_through: Callable[["_AcrossGroups"], None]) -> None:
        self._within, self._output, self._across = within, output, across
        self._average, self._tag = average, tag
        self._launch_through = launch_through   # the earlier ones' all-reduces go first
        self._handle: Optional[Handle] = None

    def ready(self) -> bool:
        """Whether the reduce-scatter is known to be complete (its handle says so)."""
        if self._handle is not None:
            return True
        done = getattr(self._within, "done", None)
        return bool(done is not None and done())

    def launch(self) -> None:
        """Finish the reduce-scatter and start the all-reduce (once)."""
        if self._handle is None:
            self._within.wait()
            self._handle = self._across.all_reduce(self._output, op="sum", tag=self._tag)

    def wait(self) -> None:
        self._launch_through(self)
        self.launch()
        self._handle.wait()
        if self._average and self._across.world_size > 1:
            self._output.div_(self._across.world_size)
        self._average = False


class HybridComm:
    """The :class:`~zkernels.comm.base.Comm` of one shard group, whose reduce-scatters also
    all-reduce their shard across the replicate group (see [Note: hybrid sharding is a group
    shape]).

    Args:
        shard: the collectives of this rank's shard group (K ranks).
        replicate: the collectives of this rank's replicate group (N/K ranks, one per group).
        world: the collectives of all N ranks (checkpoint agreement).

    Attributes:
        rank, world_size: within the shard group (what layouts are built with).
        replica_rank, num_replicas: this rank's group index and the number of groups.
        data_parallel_size: N, the ranks gradients are averaged over.
    """

    def __init__(self, shard: Comm, replicate: Comm, world: Comm) -> None:
        if shard.world_size * replicate.world_size != world.world_size:
            raise ValueError(f"a shard group of {shard.world_size} ranks times "
                             f"{replicate.world_size} replicas is not the world's "
                             f"{world.world_size} ranks")
        self.shard, self.replicate, self.world = shard, replicate, world
        self.rank, self.world_size = shard.rank, shard.world_size
        self.replica_rank, self.num_replicas = replicate.rank, replicate.world_size
        self.data_parallel_size = world.world_size
        self._pending: Deque[_AcrossGroups] = deque()

    @property
    def inner(self) -> "HybridComm":
        """The same groups without volume meters (checkpoint traffic is not a step's)."""
        parts = [getattr(c, "inner", c) for c in (self.shard, self.replicate, self.world)]
        return HybridComm(*parts)

    def progress(self) -> None:
        """Start the cross-group all-reduce of every reduce-scatter seen complete, in launch
        order (a reduce-scatter not yet complete holds back the ones after it)."""
        while self._pending and self._pending[0].ready():
            self._pending.popleft().launch()

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *,
                       average: bool = False, tag: Optional[str] = None) -> Handle:
        self.progress()
        within = self.shard.reduce_scatter(output, input, average=average, tag=tag)
        h = _AcrossGroups(within, output, self.replicate, average, tag, self._launch_through)
        self._pending.append(h)
        return h

    def _launch_through(self, h: _AcrossGroups) -> None:
        """Start the all-reduces of every pending reduce-scatter up to ``h``, in order (a
        handle waited before an earlier one must not reorder the replicate group's
        collectives)."""
        while h in self._pending:
            self._pending.popleft().launch()

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *,
                   tag: Optional[str] = None) -> Handle:
        self.progress()
        return self.shard.all_gather(output, input, tag=tag)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *,
                   tag: Optional[str] = None) -> Handle:
        """Within the shard group (the whole-matrix optimizers' exchanges)."""
        self.progress()
        return self.shard.all_to_all(output, input, tag=tag)

    def all_reduce(self, tensor: torch.Tensor, *, op: str = "sum",
                   tag: Optional[str] = None) -> Handle:
        """Within the shard group (the norm's sum of squares, the stage-3 path checks)."""
        self.progress()
        return self.shard.all_reduce(tensor, op=op, tag=tag)


def check_shard_size(shard_size, world_size: int) -> Optional[int]:
    """``shard_size`` as an int that divides ``world_size``, or None.

    Raises:
        TypeError: not an int.
        ValueError: < 1 or not a divisor of ``world_size``.
    """
    if shard_size is None:
        return None
    if isinstance(shard_size, bool) or not isinstance(shard_size, int):
        raise TypeError(f"shard_size must be an int (ranks per shard group) or None, got "
                        f"{type(shard_size).__name__}")
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    if world_size % shard_size:
        raise ValueError(f"shard_size={shard_size} must divide the number of ranks "
                         f"({world_size})")
    return shard_size


def hybrid_groups(process_group, shard_size: int) -> Tuple[object, object]:
    """``(shard group, replicate group)`` of this rank when ``process_group``'s ranks are cut
    into groups of ``shard_size`` consecutive ranks. Collective over the default group: every
    rank must call it (``dist.new_group`` for every group, in the same order)."""
    import torch.distributed as dist
    ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
    n = len(ranks)
    me = dist.get_rank()
    shard = replicate = None
    for g in range(n // shard_size):
        members = ranks[g * shard_size:(g + 1) * shard_size]
        pg = dist.new_group(members)
        if me in members:
            shard = pg
    for r in range(shard_size):
        members = ranks[r::shard_size]
        pg = dist.new_group(members)
        if me in members:
            replicate = pg
    return shard, replicate


def mesh_groups(mesh) -> Tuple[object, object, object]:
    """``(shard group, replicate group, world group)`` of a 2-D ``DeviceMesh`` (dim 0
    replicate, dim 1 shard, as FSDP2's HSDP); the world is the mesh's whole group.

    Raises:
        ValueError: the mesh is not 2-D.
    """
    import torch.distributed as dist
    if mesh.ndim != 2:
        raise ValueError(f"mesh must be a 2-D DeviceMesh (replicate, shard) for hybrid "
                         f"sharding, got {mesh.ndim} dimensions (a 1-D mesh: pass "
                         f"process_group=mesh.get_group())")
    ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
    world = None if len(ranks) == dist.get_world_size() else dist.new_group(ranks)
    return mesh.get_group(1), mesh.get_group(0), world


def make_metered_comm(process_group, device, backend: str, timeout, meter, *,
                      shard_size=None, mesh=None):
    """The data-parallel comm the optimizer talks to, every collective counted into ``meter``:
    a plain :class:`~zkernels.comm.meter.MeteredComm`, or with ``shard_size`` / a 2-D
    ``mesh`` a :class:`HybridComm` whose shard group is metered as ``"within_group"`` and
    whose replicate group as ``"across_groups"``.

    Args:
        process_group: the data-parallel group (None: the world), or a ``DeviceMesh``
            (1-D: its group; 2-D: hybrid, like ``mesh``).
        device, backend, timeout: as :func:`~zkernels.comm.select.make_comm`.
        meter: the :class:`~zkernels.comm.meter.VolumeMeter`.
        shard_size: ranks per shard group (K), dividing the group's N; K = N is plain ZeRO
            and K = 1 keeps every state whole on every rank (DDP with a replicated optimizer).
        mesh: a 2-D ``DeviceMesh`` (dim 0 replicate, dim 1 shard).

    Raises:
        TypeError, ValueError: a bad ``shard_size`` or ``mesh`` (the message names it).
    """
    from .local import LocalComm
    from .meter import MeteredComm
    from .select import make_comm
    if is_device_mesh(process_group):
        if mesh is not None:
            raise ValueError("pass the DeviceMesh as process_group= or mesh=, not both")
        process_group, mesh = None, process_group
        if mesh.ndim == 1:
            process_group, mesh = mesh.get_group(), None
    elif mesh is not None:
        if not is_device_mesh(mesh):
            raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got "
                            f"{type(mesh).__name__}")
        if process_group is not None:
            raise ValueError("pass either process_group= or mesh=, not both")
    plain = make_comm(process_group, device, backend, timeout)
    if mesh is None:
        k = check_shard_size(shard_size, plain.world_size)
        if k is None or k == plain.world_size:
            return MeteredComm(plain, meter)
        shard_pg, rep_pg = hybrid_groups(process_group, k)
        world = plain
    else:
        shard_pg, rep_pg, world_pg = mesh_groups(mesh)
        world = plain if world_pg is None else make_comm(world_pg, device, backend, timeout)
        k = check_shard_size(shard_size, world.world_size)
        if k is not None and k != mesh.size(1):
            raise ValueError(f"shard_size={k} disagrees with the mesh's shard dimension "
                             f"({mesh.size(1)} ranks)")

    def part(pg, size: int, scope: str):
        inner = LocalComm() if size == 1 else make_comm(pg, device, backend, timeout)
        return MeteredComm(inner, meter, scope=scope)

    import torch.distributed as dist
    return HybridComm(part(shard_pg, dist.get_world_size(shard_pg), "within_group"),
                      part(rep_pg, dist.get_world_size(rep_pg), "across_groups"),
                      MeteredComm(world, meter, scope="within_group"))


def is_device_mesh(obj) -> bool:
    """Whether ``obj`` is a ``torch.distributed.device_mesh.DeviceMesh``."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # a torch without device meshes has none to pass
        return False
    return isinstance(obj, DeviceMesh)
