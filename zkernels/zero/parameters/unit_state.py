"""The states of stage 3's units and the moves each allows, in one place.

[Note: unit states]
As FSDP2's, each sharded flat's storage (``units.ShardedParams``) is a ``ShardedState`` and
each unit (``stage3.GatherUnit``) in a ``TrainingState``; a move ``LEGAL`` does not list
raises, naming the unit and both states.

- Storage: SHARDED (this rank's shard only) -> UNSHARDING (full buffer allocated, all-gather
  in flight) -> UNSHARDED (the parameters are views of it) -> SHARDED (``free``), or
  SHARDED_POST_FORWARD (``reshard``: ``reshard_after_forward=R`` keeps the secondary chunk,
  [Note: secondary shards]; the next gather stays within the secondary group).
- Step: IDLE -> FORWARD -> POST_FORWARD (it ran with autograd: a backward will need it;
  ``reshard_after_forward=False`` keeps it gathered) -> PRE_BACKWARD (a gradient reached its
  outputs: gathered) -> POST_BACKWARD (no node needs it: freed) -> IDLE (the end of backward
  resets every unit). A recompute (activation checkpointing) runs a forward inside backward
  and leaves the state; reentrant checkpointing's nested backward moves IDLE -> POST_BACKWARD,
  a second backward through a retained graph IDLE -> PRE_BACKWARD.

- The schedule (``stage3.GatherSchedule``): IDLE -> BACKWARD (the first pre-backward hook of a
  backward; it queues the end-of-backward callback) -> IDLE (that callback, or the next
  forward's hook when a backward raised and its callback never ran). Its hooks read it: in
  BACKWARD a forward is a recompute (gathered, never freed by its post-forward hook), and
  ``gathered()`` leaves the freeing to the end of backward.

Counts stay counts beside the state: forwards on the stack (``depth``), ``gathered()``
contexts (``pins``), input-gradient hooks not yet fired, parameters whose gradients are in.
"""
import enum

ShardedState = enum.Enum("ShardedState", "SHARDED SHARDED_POST_FORWARD UNSHARDING UNSHARDED")
TrainingState = enum.Enum("TrainingState", "IDLE FORWARD POST_FORWARD PRE_BACKWARD POST_BACKWARD")
SchedulePhase = enum.Enum("SchedulePhase", "IDLE BACKWARD")
S, T, P = ShardedState, TrainingState, SchedulePhase
LEGAL = {  # state -> the states it may move to (staying is always allowed)
    S.SHARDED: {S.UNSHARDING},
    S.SHARDED_POST_FORWARD: {S.UNSHARDING, S.SHARDED},
    S.UNSHARDING: {S.UNSHARDED, S.SHARDED, S.SHARDED_POST_FORWARD},
    S.UNSHARDED: {S.SHARDED, S.SHARDED_POST_FORWARD},
    T.IDLE: {T.FORWARD, T.PRE_BACKWARD, T.POST_BACKWARD},
    T.FORWARD: {T.IDLE, T.POST_FORWARD},
    T.POST_FORWARD: {T.PRE_BACKWARD, T.POST_BACKWARD},
    T.PRE_BACKWARD: {T.POST_BACKWARD},
    T.POST_BACKWARD: {T.PRE_BACKWARD},
    P.IDLE: {P.BACKWARD},
    P.BACKWARD: {P.IDLE},
}


def move(name: str, current: enum.Enum, new: enum.Enum) -> enum.Enum:
    """``new`` if ``current`` may move to it, else a RuntimeError naming ``name`` and both."""
    if new is not current and new not in LEGAL[current]:
        raise RuntimeError(f"stage 3: {name} cannot move from {current.name} to {new.name} "
                           f"(legal: {sorted(s.name for s in LEGAL[current])}; see [Note: unit "
                           f"states] in zkernels/zero/parameters/unit_state.py)")
    return new
