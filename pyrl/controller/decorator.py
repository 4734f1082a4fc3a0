"""@register: how the driver splits a group call's arguments across workers and gathers the results.

A worker method decorated with @register(dispatch_mode=...) becomes a method of its WorkerGroup:
the dispatch function turns the driver's (args, kwargs) into one (args, kwargs) per rank, the workers
run, and the collect function turns their outputs into the driver's result.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

from pyrl.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto

PYRL_REGISTER_ATTR = "_pyrl_register"


class Dispatch(str, Enum):
    ONE_TO_ALL = "one_to_all"  # the same arguments to every rank; results as a list
    ALL_TO_ALL = "all_to_all"  # every argument is a list of world_size items, item i to rank i; list
    DP_COMPUTE = "dp_compute"  # as ALL_TO_ALL (data-parallel compute on pre-split inputs)
    DP_COMPUTE_PROTO = "dp_compute_proto"  # DataProtos padded to a multiple of world_size, chunked; concat back
    DP_COMPUTE_METRIC = "dp_compute_metric"  # DataProtos split as DP_COMPUTE_PROTO; results as a list


class Execute(str, Enum):
    ALL = "all"
    RANK_ZERO = "rank_zero"


@dataclass(frozen=True)
class DispatchMode:
    dispatch: Callable  # (world_size, args, kwargs) -> (list of per-rank args, list of per-rank kwargs, context)
    collect: Callable  # (outputs, context) -> result


def _one_to_all(world_size, args, kwargs):
    return [args] * world_size, [kwargs] * world_size, None


def _split_lists(world_size, args, kwargs):
    for name, value in [*((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items()]:
        if not isinstance(value, (list, tuple)) or len(value) != world_size:
            raise ValueError(f"{name}: this dispatch mode needs a list of {world_size} items (one per rank), "
                             f"got {type(value).__name__}"
                             f"{'' if not hasattr(value, '__len__') else f' of {len(value)}'}")
    per_rank_args = [tuple(a[r] for a in args) for r in range(world_size)]
    per_rank_kwargs = [{k: v[r] for k, v in kwargs.items()} for r in range(world_size)]
    return per_rank_args, per_rank_kwargs, None


def _split_protos(world_size, args, kwargs):
    """Every DataProto argument padded (with copies of its leading rows) to a multiple of world_size and
    chunked; other arguments go to every rank as they are. The padding is stripped after collection. Context:
    (padding rows, padded rows) of the arguments."""
    pad_size, padded_rows = None, 0
    per_rank_args, per_rank_kwargs = [[] for _ in range(world_size)], [{} for _ in range(world_size)]

    def split(name, value):
        nonlocal pad_size, padded_rows
        if not isinstance(value, DataProto):
            return [value] * world_size
        padded, pad = pad_dataproto_to_divisor(value, world_size)
        if pad_size is not None and pad != pad_size:
            raise ValueError(f"{name}: DataProto arguments of one call must have the same length")
        pad_size, padded_rows = pad, len(padded)
        return padded.chunk(world_size)

    for i, value in enumerate(args):
        for r, piece in enumerate(split(f"argument {i}", value)):
            per_rank_args[r].append(piece)
    for key, value in kwargs.items():
        for r, piece in enumerate(split(key, value)):
            per_rank_kwargs[r][key] = piece
    return [tuple(a) for a in per_rank_args], per_rank_kwargs, (pad_size or 0, padded_rows)


def _as_list(outputs, context):
    return list(outputs)


def _concat_protos(outputs, padding):
    """The ranks' outputs in order, less the padding's: a method that returns k rows per input row (generation's
    n samples) returns k per padding row too."""
    for rank, out in enumerate(outputs):
        if not isinstance(out, DataProto):
            raise TypeError(f"rank {rank} returned {type(out).__name__}; DP_COMPUTE_PROTO methods must return a "
                            "DataProto")
    out = DataProto.concat(outputs)
    pad_size, padded_rows = padding
    if not pad_size:
        return out
    if len(out) % padded_rows:
        raise ValueError(f"the ranks returned {len(out)} rows for {padded_rows} padded input rows: not a whole number "
                         f"per row, so the {pad_size} padding rows cannot be told apart")
    return unpad_dataproto(out, pad_size * (len(out) // padded_rows))


DISPATCH_MODES: dict[Any, DispatchMode] = {
    Dispatch.ONE_TO_ALL: DispatchMode(_one_to_all, _as_list),
    Dispatch.ALL_TO_ALL: DispatchMode(_split_lists, _as_list),
    Dispatch.DP_COMPUTE: DispatchMode(_split_lists, _as_list),
    Dispatch.DP_COMPUTE_PROTO: DispatchMode(_split_protos, _concat_protos),
    Dispatch.DP_COMPUTE_METRIC: DispatchMode(_split_protos, _as_list),
}


def register_dispatch_mode(name: str, dispatch: Callable, collect: Callable) -> None:
    """Add a dispatch mode: dispatch(world_size, args, kwargs) -> (per-rank args, per-rank kwargs, context),
    collect(outputs, context) -> result. Use the name in @register(dispatch_mode=name)."""
    if name in DISPATCH_MODES:
        raise ValueError(f"dispatch mode {name!r} is already registered")
    DISPATCH_MODES[name] = DispatchMode(dispatch, collect)


def register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.ALL, blocking: bool = True):
    """Mark a Worker method as a group method with this dispatch mode. execute_mode RANK_ZERO runs it on
    rank 0 only (its result is returned as is); blocking=False returns Ray object refs to ray.get later."""
    if dispatch_mode not in DISPATCH_MODES:
        raise ValueError(f"dispatch_mode: unknown {dispatch_mode!r}; known: "
                         f"{[str(getattr(m, 'value', m)) for m in DISPATCH_MODES]}")
    execute_mode = Execute(execute_mode)

    def decorate(fn):
        setattr(fn, PYRL_REGISTER_ATTR, (dispatch_mode, execute_mode, blocking))
        return fn

    return decorate
