"""Whole-matrix ``torch.optim`` classes (Muon, Adafactor): each parameter updated whole, once
per step, by one owner rank of its shard group.

[Note: whole matrices on owners]
``torch.optim.Muon`` orthogonalizes the whole momentum matrix (Newton-Schulz) and
``torch.optim.Adafactor`` keeps row and column factors and reads the parameter's norm: neither
runs on pieces. So every parameter of such a group gets one *owner* in its shard group,
taken largest first within each unit as units are built (cost: ``m * n * min(m, n)`` for
Muon's Newton-Schulz, the element count for Adafactor), the same on every rank: among the
ranks that keep the most loaded rank's cost as low as the least loaded one taking it would,
the one holding the largest piece of it (the least traffic). The owner keeps the parameter's
whole fp32 master and the class's state (one instance of the class per param group, over the
whole tensors it owns: the class's own code, shapes and ``state``); the other ranks keep only
their pieces of the fp32 master, as for any parameter. Before the units update, one step moves:

1. *to the owners*: each rank sends the owner of every matrix its piece of the reduced
   gradient shard (fp32), all owners at once: one ``all_to_all`` of N equal chunks (each
   padded to the largest), counted by the meter as ``"reduce_scatter"`` (it finishes
   delivering gradients). The first step, and the first after a write of the masters from
   outside the step (``model.load_state_dict``, pretrained weights), also send the master
   pieces, so the owner's whole master follows the shards.
2. each owner divides the whole gradient by the step's ``grad_scale`` and runs its class's
   ``step()`` on its whole tensors (a parameter without a gradient this step keeps ``.grad``
   None: the class skips it). Newton-Schulz runs once per matrix in the group, on its owner.
3. *back*: each owner sends every rank holding a piece of its matrices that piece of the
   updated fp32 master: one ``all_to_all`` the other way, counted as ``"all_gather"`` (it
   publishes parameters). Every rank writes the pieces into its master shard; the engine
   then writes the compute shard from the master, and the all-gather that publishes
   parameters anyway (stages 1-2; stage 3's next gather) takes it to everyone.

Traffic beyond ZeRO's 2Ψ (3Ψ at stage 3): a rank sends its pieces of the matrices others own
and, as owner, the others' pieces of its own. With balanced owners that is about
``2 Ψ_m (N - 1) / N**2`` bytes per rank for Ψ_m bytes of matrices (``Ψ_m / 2`` at N = 2),
and owners holding their largest pieces less, but the padding of every chunk to the largest
adds the pairs' imbalance: measured 0.54 Ψ_m per shard group of 2 on the battery's GPT
(hybrid, K = 2) and under ``Ψ_m / 2`` on tests/zero/test_matrix_optim.py's MLP, which holds
it to that. Memory: the owners' whole masters add 4 bytes per matrix element over
the group (``optimizer_spec.MATRIX``); the whole gradient lives on the owner during the step.
With NVMe offload the owners' whole masters and state live in files, one matrix in RAM at a
time ([Note: whole matrices on NVMe] in ``matrix_swap.py``).

Checkpoints stay per piece: :meth:`MatrixUpdate.piece_states` (collective over the shard
group) sends each rank its pieces of the owner's state, every state tensor broadcast to the
parameter's shape first (Adafactor's ``row_var`` [.., m, 1] saved as [.., m, n], each row's
value repeated), and 0-dim state (``step``) as a number per piece; :meth:`load_pieces`
gathers them back to the (new) owner and takes the factors from one column (row). So a
checkpoint reshards to any world size, stage or owner like an element-wise class's. The
owner's class format is what ``opt.state_dict()`` saves (:meth:`owned_states`).
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..planning.matrix_plan import OwnerPlan, matrix_cost
from ..planning.optimizer_spec import OptimizerSpec

# Each class's state tensors (their keys) and 0-dim state for a parameter of ``ndim`` dims.
_KEYS = {
    "Muon": lambda ndim: (("momentum_buffer",), ()),
    "Adafactor": lambda ndim: ((("row_var", "col_var") if ndim > 1 else ("variance",)),
                               ("step",)),
}


@dataclass
class _Item:
    """One parameter of a matrix group: where it lies in its unit and who owns it."""

    unit_index: int
    pos: int
    name: str
    shape: Tuple[int, ...]
    offset: int
    numel: int
    group_index: int
    owner: int
    pieces: List[Tuple[int, int, int]]   # per rank: (start in param, start in shard, length)


def _scaled(g: torch.Tensor, grad_scale) -> torch.Tensor:
    if grad_scale is None:
        return g
    if isinstance(grad_scale, torch.Tensor) and grad_scale.device != g.device:
        grad_scale = float(grad_scale.item())
    return g.div_(grad_scale)


class MatrixUpdate:
    """The owners, the two exchanges and the owners' state of every whole-matrix group (see
    [Note: whole matrices on owners]).

    Args:
        rank, world_size: this rank in the shard group.
        specs: each param group's :class:`OptimizerSpec`.
        store: where the owned whole masters and state live, the state's place's
            (``place.whole_store()``, ``matrix_swap.py``): in memory beside the state, or
            in files with NVMe offload, one matrix in RAM at a time ([Note: whole matrices
            on NVMe]; it ``streams``).
    """

    def __init__(self, rank: int, world_size: int, specs: Sequence[OptimizerSpec],
                 store) -> None:
        self.rank, self.world_size, self.specs = rank, world_size, list(specs)
        self.store = store
        self.items: List[_Item] = []
        self.records: Dict[int, object] = {}          # unit index -> ShardState
        self.owners = OwnerPlan(world_size)   # (planning/matrix_plan.py: the estimate's too)
        self.whole: Dict[int, torch.Tensor] = {}      # item index -> owner's fp32 master
        self.inner: Dict[int, torch.optim.Optimizer] = {}   # group index -> the class
        self.stale = True   # the owners' whole masters must be (re)read from the shards
        self.device: Optional[torch.device] = None
        self.checkpoint_comm = None   # the shard group's comm, unmetered (set by the optimizer)

    # -- construction -------------------------------------------------------------------

    def add_unit(self, rec) -> None:
        """Register ``rec``'s unit (a matrix group's): check every parameter's shape, give
        each an owner. Raises ValueError naming a parameter the class cannot take."""
        unit = rec.unit
        spec = self.specs[unit.group_index]
        if self.device is None:
            self.device = unit.device
        self.records[unit.index] = rec
        lay = unit.layout
        new = []
        for i, (name, shape) in enumerate(zip(unit.names, unit.shapes)):
            shape = tuple(shape)
            if spec.name == "Muon" and len(shape) != 2:
                raise ValueError(
                    f"param_groups[{unit.group_index}]: parameter {name!r} has shape "
                    f"{list(shape)}: torch.optim.Muon updates only 2-D matrices; put it in "
                    f"another group (e.g. {{'params': rest, 'lr': 3e-4}}, the fused AdamW)")
            pieces = []
            for r in range(self.world_size):
                got = [(a, s, n) for j, a, s, n in lay.tensor_slices_in_shard(r) if j == i]
                pieces.append(got[0] if got else (0, 0, 0))
            new.append(_Item(unit.index, i, name, shape, lay.offsets[i], lay.numels[i],
                             unit.group_index, -1, pieces))
        # Balanced first, then the least traffic (OwnerPlan: the rule the estimate uses).
        owners = self.owners.assign([matrix_cost(spec.name, it.shape) for it in new],
                                    [[k for _, _, k in it.pieces] for it in new])
        for it, owner in zip(new, owners):
            it.owner = owner
        for it in new:
            k = len(self.items)
            self.items.append(it)
            if it.owner == self.rank:
                self.whole[k] = self.store.new(it.shape, rec.master.device)

    def owned(self, unit_index: Optional[int] = None) -> List[int]:
        return [k for k, it in enumerate(self.items) if it.owner == self.rank and
                (unit_index is None or it.unit_index == unit_index)]

    def _class(self, gi: int, group: dict) -> Optional[torch.optim.Optimizer]:
        if gi not in self.inner:
            mine = [self.whole[k] for k in self.owned() if self.items[k].group_index == gi]
            if not mine:
                return None
            spec = self.specs[gi]
            sig = inspect.signature(spec.cls.__init__).parameters
            takes_all = any(p.kind is p.VAR_KEYWORD for p in sig.values())
            self.inner[gi] = spec.cls(mine, **{k: v for k, v in self._hparams(gi, group).items()
                                               if takes_all or k in sig})
        return self.inner[gi]

    def _hparams(self, gi: int, group: dict) -> dict:
        return {k: group[k] for k in self.specs[gi].defaults if k in group}

    def _state(self, k: int) -> dict:
        inner = self.inner.get(self.items[k].group_index)
        return inner.state.get(self.whole[k], {}) if inner is not None else {}

    @contextmanager
    def _held(self, k: int, master: str = "read", write: bool = True):
        """Owned item ``k``'s whole master and state in RAM for the block (with files: read
        in, then written back if ``write``; [Note: whole matrices on NVMe])."""
        it = self.items[k]
        self.store.bring_in(k, self.whole[k], self._state(k), master)
        try:
            yield
        finally:
            self.store.write_out(k, it.unit_index, it.pos, self.whole[k], self._state(k),
                                 master != "none", write)

    def _pieces_of(self, k: int) -> Dict[int, torch.Tensor]:
        flat, it = self.whole[k].view(-1), self.items[k]
        return {r: flat[a:a + m].clone() for r, (a, _, m) in enumerate(it.pieces) if m}

    # -- the exchanges ------------------------------------------------------------------

    def _exchange(self, comm, meter, kind: str, send: Dict[int, List[torch.Tensor]],
                  sizes: List[List[int]]) -> List[torch.Tensor]:
        """Send ``send[q]`` (tensors, concatenated) to rank q; ``sizes[r][q]``: elements rank
        r sends rank q (known to every rank). Returns what each rank sent here. ``meter``
        None: unmetered (checkpoint traffic)."""
        n = self.world_size
        chunk = max((sizes[r][q] for r in range(n) for q in range(n) if r != q), default=0)
        if chunk == 0:
            return [torch.empty(0, device=self.device) for _ in range(n)]
        buf = torch.zeros(n * chunk, dtype=torch.float32, device=self.device)
        for q, parts in send.items():
            if q == self.rank:
                continue
            pos = q * chunk
            for t in parts:
                buf[pos:pos + t.numel()].copy_(t.reshape(-1))
                pos += t.numel()
        out = torch.empty_like(buf)
        raw = getattr(comm, "inner", comm)
        if meter is not None:
            meter.record(kind, buf.numel() * 4, n)
        raw.all_to_all(out, buf, tag=f"matrix optimizer {kind}").wait()
        return [out[r * chunk:(r + 1) * chunk] for r in range(n)]

    def step(self, comm, meter, shards: Sequence[torch.Tensor], grad_scale, live,
             groups: Sequence[dict]) -> None:
        """One step of every matrix group (see the Note); ``shards[u]``: unit u's reduced
        gradient shard; ``live[u]``: its per-parameter gradient flags (None: all)."""
        if not self.items:
            return
        shards = self.store.gradients(shards, self.records)   # (NVMe: to the host, counted)
        n, me, stale = self.world_size, self.rank, self.stale
        per = 2 if stale else 1
        sizes = [[0] * n for _ in range(n)]
        send: Dict[int, List[torch.Tensor]] = {q: [] for q in range(n)}
        for it in self.items:
            for r in range(n):
                sizes[r][it.owner] += per * it.pieces[r][2]
            _, s, k = it.pieces[me]
            if k and it.owner != me:
                send[it.owner].append(shards[it.unit_index][s:s + k].float().to(self.device))
                if stale:
                    send[it.owner].append(self.records[it.unit_index].master[s:s + k]
                                          .to(self.device))
        got = self._exchange(comm, meter, "reduce_scatter", send, sizes)
        cursor = [0] * n
        stepped = set()
        sent: Dict[int, Dict[int, torch.Tensor]] = {}   # (files) each item's pieces
        for kk in self.owned():
            it = self.items[kk]
            w = self.whole[kk]
            with self._held(kk, "fresh" if stale else "read"):
                self._gather_one(it, w, shards, got, cursor, stale, per, grad_scale, live)
                if self.store.streams:   # one matrix at a time (its own class step)
                    self._step_one(kk, groups[it.group_index])
                    sent[kk] = self._pieces_of(kk)
            stepped.add(it.group_index)
        self.stale = False
        if not self.store.streams:
            for gi in sorted(stepped):
                opt = self._class(gi, groups[gi])
                opt.param_groups[0].update(self._hparams(gi, groups[gi]))
                try:
                    opt.step()
                finally:
                    for p in opt.param_groups[0]["params"]:
                        p.grad = None
        self._publish(comm, meter, sent)

    def _step_one(self, k: int, group: dict) -> None:
        gi = self.items[k].group_index
        opt = self._class(gi, group)
        opt.param_groups[0].update(self._hparams(gi, group))
        try:
            opt.step()   # (the other parameters' .grad is None: skipped)
        finally:
            self.whole[k].grad = None

    def _gather_one(self, it, w, shards, got, cursor, stale, per, grad_scale,
                    live) -> None:
        """An owned item's whole gradient (and, ``stale``, master) from the pieces."""
        n, me = self.world_size, self.rank
        g = torch.empty(it.numel, dtype=torch.float32, device=w.device)
        flat_w = w.view(-1)
        for r in range(n):
            a, s, k = it.pieces[r]
            if not k:
                continue
            if r == me:
                g[a:a + k] = shards[it.unit_index][s:s + k]
                if stale:
                    flat_w[a:a + k] = self.records[it.unit_index].master[s:s + k]
                continue
            c = cursor[r]
            g[a:a + k] = got[r][c:c + k]
            if stale:
                flat_w[a:a + k] = got[r][c + k:c + 2 * k]
            cursor[r] += per * k
        flags = live[it.unit_index] if live is not None else None
        w.grad = _scaled(g, grad_scale).view(it.shape) \
            if flags is None or flags[it.pos] else None

    def _publish(self, comm, meter, sent: Dict[int, Dict[int, torch.Tensor]]) -> None:
        """Every rank's master pieces from the owners' whole masters (the Note's step 3);
        ``sent``: owned items' pieces by rank, copied out at their step (a store that streams)."""
        n, me = self.world_size, self.rank

        def piece(k: int, r: int) -> torch.Tensor:
            if k in sent:
                return sent[k][r]
            a, _, m = self.items[k].pieces[r]
            return self.whole[k].view(-1)[a:a + m]

        sizes = [[0] * n for _ in range(n)]
        send: Dict[int, List[torch.Tensor]] = {q: [] for q in range(n)}
        for k, it in enumerate(self.items):
            for r in range(n):
                sizes[it.owner][r] += it.pieces[r][2]
            if it.owner == me:
                for r in range(n):
                    if it.pieces[r][2] and r != me:
                        send[r].append(piece(k, r))
        got = self._exchange(comm, meter, "all_gather", send, sizes)
        cursor = [0] * n
        for k, it in enumerate(self.items):
            a, s, m = it.pieces[me]
            if not m:
                continue
            master = self.records[it.unit_index].master
            if it.owner == me:
                master[s:s + m] = piece(k, me)
            else:
                c = cursor[it.owner]
                master[s:s + m] = got[it.owner][c:c + m]
                cursor[it.owner] += m

    # -- checkpoints --------------------------------------------------------------------

    def _keys(self, it: _Item) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
        return _KEYS[self.specs[it.group_index].name](len(it.shape))

    def piece_states(self, comm, unit_index: int) -> List[Dict[str, torch.Tensor]]:
        """This rank's pieces of the owners' state for ``unit_index``'s parameters, in
        ``param_slices_in_shard`` order (collective over the shard group; see the Note).
        Before the unit's first step: empty dicts, nothing sent."""
        rec = self.records[unit_index]
        items = [(k, it) for k, it in enumerate(self.items) if it.unit_index == unit_index]
        if rec.step == 0:
            return [{} for _, it in items if it.pieces[self.rank][2]]
        n, me = self.world_size, self.rank
        sizes = [[0] * n for _ in range(n)]
        send: Dict[int, List[torch.Tensor]] = {q: [] for q in range(n)}
        full: Dict[int, List[torch.Tensor]] = {}
        for k, it in items:
            keys, scalars = self._keys(it)
            for r in range(n):
                m = it.pieces[r][2]
                if m:
                    sizes[it.owner][r] += len(keys) * m + len(scalars) + 1
            if it.owner != me:
                continue
            with self._held(k, "none", write=False):
                st = self._state(k)
                has = torch.tensor([1.0 if st else 0.0], device=self.whole[k].device)
                tens = [st[key].expand(it.shape).reshape(-1).clone() if key in st else
                        torch.zeros(it.numel, device=self.whole[k].device) for key in keys]
            sc = torch.tensor([float(st.get(key, 0.0)) for key in scalars],
                              device=self.whole[k].device)
            full[k] = (tens, sc, has)
            for r in range(n):
                a, _, m = it.pieces[r]
                if m and r != me:
                    send[r] += [t[a:a + m] for t in tens] + [sc, has]
        got = self._exchange(comm, None, "all_gather", send, sizes)
        cursor = [0] * n
        out = []
        for k, it in items:
            keys, scalars = self._keys(it)
            a, _, m = it.pieces[me]
            if not m:
                continue
            if it.owner == me:
                tens, sc, has = full[k]
                vals = [t[a:a + m].clone() for t in tens] + [sc.clone(), has.clone()]
            else:
                c, vals = cursor[it.owner], []
                src = got[it.owner]
                for _ in keys:
                    vals.append(src[c:c + m].clone())
                    c += m
                vals += [src[c:c + len(scalars)].clone(), src[c + len(scalars):
                                                              c + len(scalars) + 1].clone()]
                cursor[it.owner] = c + len(scalars) + 1
            if float(vals[-1][0]) == 0.0:
                out.append({})
                continue
            st = dict(zip(keys, vals[:len(keys)]))
            st.update({key: torch.tensor(float(v)) for key, v in zip(scalars, vals[-2])})
            out.append(st)
        return out

    def load_pieces(self, comm, unit_index: int, states: List[Dict[str, torch.Tensor]],
                    group: dict) -> None:
        """Gather this rank's pieces of the master (the record's, already written) and of the
        state (``states``, as :meth:`piece_states` gives them) to the owners, which rebuild
        their whole master and the class's state (collective over the shard group)."""
        rec = self.records[unit_index]
        items = [(k, it) for k, it in enumerate(self.items) if it.unit_index == unit_index]
        n, me = self.world_size, self.rank
        sizes = [[0] * n for _ in range(n)]
        send: Dict[int, List[torch.Tensor]] = {q: [] for q in range(n)}
        mine: Dict[int, List[torch.Tensor]] = {}
        it_states = iter(states)
        for k, it in items:
            keys, scalars = self._keys(it)
            for r in range(n):
                m = it.pieces[r][2]
                if m:
                    sizes[r][it.owner] += (1 + len(keys)) * m + len(scalars) + 1
            _, s, m = it.pieces[me]
            if not m:
                continue
            st = next(it_states)
            vals = [rec.master[s:s + m].to(self.device)]
            vals += [st[key].reshape(-1).float().to(self.device) if key in st else
                     torch.zeros(m, device=self.device) for key in keys]
            vals.append(torch.tensor([float(st.get(key, 0.0)) for key in scalars],
                                     device=self.device))
            vals.append(torch.tensor([1.0 if st else 0.0], device=self.device))
            if it.owner == me:
                mine[k] = vals
            else:
                send[it.owner] += vals
        got = self._exchange(comm, None, "reduce_scatter", send, sizes)
        cursor = [0] * n
        for k, it in items:
            if it.owner != me:
                continue
            keys, scalars = self._keys(it)
            w = self.whole[k]
            with self._held(k, "fresh"):   # (files: written back at the end)
                tens = [torch.zeros(it.numel, device=w.device) for _ in keys]
                sc, has = None, False
                for r in range(n):
                    a, _, m = it.pieces[r]
                    if not m:
                        continue
                    if r == me:
                        vals = mine[k]
                    else:
                        c, src, vals = cursor[r], got[r], []
                        for _ in range(1 + len(keys)):
                            vals.append(src[c:c + m])
                            c += m
                        vals += [src[c:c + len(scalars)], src[c + len(scalars):
                                                              c + len(scalars) + 1]]
                        cursor[r] = c + len(scalars) + 1
                    w.view(-1)[a:a + m] = vals[0]
                    for t, v in zip(tens, vals[1:1 + len(keys)]):
                        t[a:a + m] = v
                    if float(vals[-1][0]) != 0.0:
                        sc, has = vals[-2], True
                opt = self._class(it.group_index, group)
                opt.state.pop(w, None)
                if has:
                    st = {}
                    for key, t in zip(keys, tens):
                        t = t.view(it.shape)
                        st[key] = t[..., :, :1].clone() if key == "row_var" else \
                            t[..., :1, :].clone() if key == "col_var" else t.clone()
                    st.update({key: torch.tensor(float(v)) for key, v in zip(scalars, sc)})
                    opt.state[w] = st

    def owned_states(self, unit_index: int) -> Dict[str, Dict[str, torch.Tensor]]:
        """The class's own state of each parameter of the unit this rank owns, by name
        (clones; a parameter without state yet has an empty dict)."""
        out = {}
        for k in self.owned(unit_index):
            with self._held(k, "none", write=False):
                out[self.items[k].name] = {key: v.clone() if isinstance(v, torch.Tensor)
                                           else v for key, v in self._state(k).items()}
        return out

    def load_owned(self, unit_index: int, states: Dict[str, dict], group: dict) -> None:
        """Restore :meth:`owned_states` (same world size and layout: same owners); the whole
        masters are read from the shards at the next step."""
        for k in self.owned(unit_index):
            it = self.items[k]
            opt = self._class(it.group_index, group)
            opt.state.pop(self.whole[k], None)
            st = states.get(it.name)
            if st:
                with self._held(k, "none"):   # (files: the state written to them)
                    opt.state[self.whole[k]] = {key: v.clone().to(self.whole[k].device)
                                                if isinstance(v, torch.Tensor) else v
                                                for key, v in st.items()}
        self.stale = True

    def held(self, unit_index: int) -> List[torch.Tensor]:
        """The owner's tensors of the unit's parameters (whole masters, state; in files with
        NVMe: none held between steps)."""
        out = []
        if self.store.streams:
            return out
        for k in self.owned(unit_index):
            out.append(self.whole[k])
            inner = self.inner.get(self.items[k].group_index)
            if inner is not None:
                out += [t for t in inner.state.get(self.whole[k], {}).values()
                        if isinstance(t, torch.Tensor) and t.dim() > 0]
        return out


class MatrixUnitRule:
    """A matrix group's unit in the engine: its update happened in :meth:`MatrixUpdate.step`
    before the units' (the master pieces are written); the engine only writes the compute
    shard. Checkpoint calls go to the shared :class:`MatrixUpdate`."""

    def __init__(self, matrix: MatrixUpdate, unit_index: int) -> None:
        self.matrix, self.unit_index = matrix, unit_index

    def step(self, grad, group, grad_scale, live=None) -> None:
        return None   # (MatrixUpdate.step wrote the master pieces)

    def piece_states(self) -> List[Dict[str, torch.Tensor]]:
        return self.matrix.piece_states(self.matrix.checkpoint_comm, self.unit_index)

    def load(self, states, group: dict) -> None:
        self.matrix.load_pieces(self.matrix.checkpoint_comm, self.unit_index, states,
                                 group)

    def master_written(self) -> None:
        self.matrix.stale = True

    def held(self) -> List[torch.Tensor]:
        return self.matrix.held(self.unit_index)
