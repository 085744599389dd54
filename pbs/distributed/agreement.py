"""Ranks agree before they compute: one small all-gather of what each rank was asked to do.

A collective that the ranks enter with different arguments hangs until the process group's
timeout (a rank raised before it, or took another path), aborts the process (gloo, when the
sizes differ) or returns a result that matches neither rank's arguments. So every multi-rank
entry point (`pbs.distributed.context_parallel_attend`, its transformers layer, the
tensor-parallel integration) starts with `agree`: each rank runs its local checks without
raising, then the ranks all-gather one record of `RECORD_BYTES` bytes each (the call, a digest
of the config, the scale, the dtype, the shapes, and the local checks' outcome), and every rank
reads the same table and raises the same ``ValueError`` when a rank's checks failed or a field
differs. Only when the config digests differ do the ranks exchange their configs (a second
all-gather, entered by every rank since every rank saw the difference), to name the fields.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch

from pbs.distributed.collectives import torch_distributed

RECORD_BYTES = 1024
"""Bytes per rank of the agreement all-gather: the record as JSON, zero-padded (a long failure
message is cut to fit)."""

_ABSENT: Any = object()  # a field one rank's record lacks
_SHOWN_FIELDS = 6  # config fields named in one error; the rest are counted
_SAME_CALL = ": every rank must make the call with the same arguments"


def record_device(group: Any, like: object) -> torch.device:
    """Where the record tensor must live for ``group``'s backend: the CPU for gloo, a CUDA device
    for NCCL (``like``'s when it is a CUDA tensor, else the current one)."""
    dist = torch_distributed()
    backend = str(dist.get_backend(group)).lower()
    on_cuda = isinstance(like, torch.Tensor) and like.is_cuda
    if "gloo" in backend:
        return torch.device("cpu")
    if "nccl" in backend:
        return like.device if on_cuda else torch.device("cuda", torch.cuda.current_device())  # type: ignore[union-attr]
    if isinstance(like, torch.Tensor) and not like.is_meta:
        return like.device
    return torch.device("cpu")


def config_text(config: Any) -> str | None:
    """The canonical JSON of a config (a pydantic model or a mapping), or None for none."""
    if config is None:
        return None
    data = config.model_dump(mode="json") if hasattr(config, "model_dump") else dict(config)
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def tensor_fields(**tensors: object) -> dict[str, Any]:
    """``dtype`` and ``device`` of the first tensor given, or None where it is not a tensor
    (the local checks then say why)."""
    first = next(iter(tensors.values()))
    if not isinstance(first, torch.Tensor):
        return {"dtype": None, "device": None}
    return {"dtype": str(first.dtype).removeprefix("torch."), "device": first.device.type}


def dim(x: object, axis: int) -> int | None:
    """``x.shape[axis]``, or None where ``x`` is not a tensor of that many dimensions."""
    if isinstance(x, torch.Tensor) and -x.dim() <= axis < x.dim():
        return int(x.shape[axis])
    return None


def agree(
    what: str,
    *,
    group: Any,
    like: object,
    config: Any,
    same: Mapping[str, Any],
    own: Mapping[str, Any] | None = None,
    failure: BaseException | None = None,
) -> list[dict[str, Any]]:
    """Exchanges this rank's record with every rank of ``group`` and checks that they agree.

    Call it on every rank of the group at the same point, before any other collective.

    Args:
        what: the call, e.g. ``"context-parallel"``; it starts the errors, and ranks in different
            calls disagree on it.
        group: the process group (None: the default one).
        like: a tensor of the call, to place the record on its device (`record_device`).
        config: this rank's config (a pydantic model, a mapping, or None): its digest must agree.
        same: JSON values (int, float, str, None) that must be equal on every rank, in the
            order the error names them (e.g. scale, dtype, shapes).
        own: JSON values this rank may hold differently (e.g. its shard's length): returned.
        failure: the error this rank's local checks raised, or None.

    Returns:
        Every rank's ``own``, in rank order.

    Raises:
        ValueError: on every rank, the same text: a rank's checks failed (naming it and its
            error), or the ranks disagree on the call, the config (naming the fields) or a
            field of ``same`` (naming the values and the ranks that hold them).
        RuntimeError: torch.distributed is not initialised (``failure``, if given, is raised
            as it is instead: no rank waits).
    """
    dist = torch_distributed()
    if not (dist.is_available() and dist.is_initialized()):
        if failure is not None:
            raise failure  # no process group: no peer waits, so the error stays as it is
        raise RuntimeError(f"{what} needs an initialised torch.distributed process group: call "
                           "torch.distributed.init_process_group (e.g. under torchrun) first")
    world = dist.get_world_size(group)
    text = config_text(config)
    record = {
        "call": what,
        "config": None if text is None else hashlib.blake2b(text.encode(), digest_size=8).hexdigest(),
        "config_bytes": 0 if text is None else len(text.encode()),
        "same": [[name, value] for name, value in same.items()],
        "own": dict(own or {}),
        "failure": None if failure is None else _describe(failure),
    }
    device = record_device(group, like)
    mine = torch.zeros(RECORD_BYTES, dtype=torch.uint8, device=device)
    data = _encode(record)
    mine[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    decoded = [_decode(row) for row in torch.stack(rows).cpu()]  # one copy to the host
    unreadable = [r for r, record in enumerate(decoded) if record is None]
    if unreadable:
        raise ValueError(f"{_ranks(unreadable)} sent no agreement record this version of pbs can read: the ranks "
                         "are in different collectives, or run different versions of pbs") from failure
    records: list[dict[str, Any]] = decoded  # type: ignore[assignment]
    problem = _first_problem(what, records)
    if problem is None and len({r["config"] for r in records}) > 1:
        configs = _exchange_configs(text, [r["config_bytes"] for r in records], group, device)
        problem = f"{what} ranks disagree on " + _config_differences(configs) + _also(records) + _SAME_CALL
    if problem is not None:
        raise ValueError(problem) from failure
    return [r["own"] for r in records]


def _describe(error: BaseException) -> str:
    message = str(error)
    return message if isinstance(error, ValueError) else f"{type(error).__name__}: {message}"


def _encode(record: dict[str, Any]) -> bytes:
    def dumps(failure: str | None) -> bytes:
        return json.dumps({**record, "failure": failure}, separators=(",", ":")).encode()

    data = dumps(record["failure"])
    if len(data) > RECORD_BYTES and record["failure"] is not None:
        # The longest start of the message that fits (escaped characters take several bytes).
        message, fits, over = record["failure"], 0, len(record["failure"])
        while over - fits > 1:
            middle = (fits + over) // 2
            fits, over = (middle, over) if len(dumps(message[:middle] + " ...")) <= RECORD_BYTES else (fits, middle)
        data = dumps(message[:fits] + " ...")
    if len(data) > RECORD_BYTES:
        raise AssertionError(f"agreement record of {len(data)} bytes exceeds {RECORD_BYTES}: {data[:200]!r}")
    return data


def _decode(row: torch.Tensor) -> dict[str, Any] | None:
    data = bytes(row.tolist()).rstrip(b"\0")
    try:
        record = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        return None
    keys = {"call", "config", "config_bytes", "same", "own", "failure"}
    return record if isinstance(record, dict) and keys <= record.keys() else None


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _by_value(values: list[Any]) -> str:
    """``rank 0: 64; ranks 1, 2, 3: 128``: the ranks grouped by the value they hold."""
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        shown = "absent" if value is _ABSENT else json.dumps(value)
        groups.setdefault(shown, []).append(rank)
    return "; ".join(f"{_ranks(ranks)}: {shown}" for shown, ranks in groups.items())


def _first_problem(what: str, records: list[dict[str, Any]]) -> str | None:
    """What every rank raises, config differences aside (they need a second exchange)."""
    calls = [record["call"] for record in records]
    if len(set(calls)) > 1:  # worded alike on every rank, whichever call it makes
        return f"the ranks disagree on the call ({_by_value(calls)}): every rank must make the same call"
    failed = [(r, record["failure"]) for r, record in enumerate(records) if record["failure"] is not None]
    if failed:
        world = len(records)
        return "; ".join(f"{what} rank {r} of {world} failed its input checks: {message}" for r, message in failed)
    differences = _same_differences(records)
    if differences and len({record["config"] for record in records}) == 1:
        return f"{what} ranks disagree on " + ", ".join(differences) + _SAME_CALL
    return None


def _same_differences(records: list[dict[str, Any]]) -> list[str]:
    fields = [dict(map(tuple, record["same"])) for record in records]
    names = list(dict.fromkeys(name for f in fields for name, _ in f.items()))
    out = []
    for name in names:
        values = [f.get(name, _ABSENT) for f in fields]
        if any(value != values[0] for value in values):
            out.append(f"{name} ({_by_value(values)})")
    return out


def _also(records: list[dict[str, Any]]) -> str:
    differences = _same_differences(records)
    return ", and on " + ", ".join(differences) if differences else ""


def _exchange_configs(text: str | None, sizes: list[int], group: Any, device: torch.device) -> list[Any]:
    """Every rank's config (decoded JSON, None for none): a second all-gather, of the longest."""
    dist = torch_distributed()
    longest = max(max(sizes), 1)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    if text:
        data = text.encode()
        mine[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    rows = [torch.empty_like(mine) for _ in sizes]
    dist.all_gather(rows, mine, group=group)
    on_host = torch.stack(rows).cpu()
    return [json.loads(bytes(row[:size].tolist())) if size else None for row, size in zip(on_host, sizes)]


def _differences(path: str, values: list[Any]) -> list[tuple[str, list[Any]]]:
    """The leaves where ``values`` (one per rank) differ; a component whose ``name`` differs is
    named by it alone (its other fields belong to another component)."""
    if all(value == values[0] for value in values):
        return []
    if all(isinstance(value, dict) for value in values):
        names = [value.get("name", _ABSENT) for value in values]
        if any(name != names[0] for name in names):
            return [(f"{path}.name", names)]
        keys = list(dict.fromkeys(key for value in values for key in value))
        return [diff for key in keys for diff in _differences(f"{path}.{key}", [v.get(key, _ABSENT) for v in values])]
    if all(isinstance(value, list) for value in values) and len({len(value) for value in values}) == 1:
        return [diff for i in range(len(values[0])) for diff in _differences(f"{path}[{i}]", [v[i] for v in values])]
    return [(path, values)]


def _config_differences(configs: list[Any]) -> str:
    if any(config is None for config in configs):
        shown = ["no config (a dense layer)" if config is None else "a config" for config in configs]
        groups: dict[str, list[int]] = {}
        for rank, value in enumerate(shown):
            groups.setdefault(value, []).append(rank)
        return "config (" + "; ".join(f"{_ranks(r)}: {v}" for v, r in groups.items()) + ")"
    diffs = _differences("config", configs)
    parts = [f"{path} ({_by_value(values)})" for path, values in diffs[:_SHOWN_FIELDS]]
    more = len(diffs) - _SHOWN_FIELDS
    return ", ".join(parts) + (f", and {more} more config fields" if more > 0 else "")
