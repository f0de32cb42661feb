"""Every rank of a CP group accepts or rejects a call together.

An op under `cp_context` is a collective: a rank that raised alone on a bad argument would
leave the others waiting in the boundary exchange until the process-group timeout. So each
rank checks its own arguments, and the ranks then all-gather one small host-side record:
a status word (ok, or the local error's type and message) and the call's signature (head
counts, head dims, dtypes, scale, options, the batch the context describes). If any rank
rejected its arguments, or the signatures differ, every rank raises the same error naming
the argument and the rank at fault, before any kernel or exchange.

The record travels over a group that moves CPU tensors without touching the device (gloo;
`cp_linattn.cp.comm.host_group`), so the check never waits for queued GPU work: its cost is
one small CPU all-gather per call (cp/README.md, section 9).
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import TypeVar

import torch

from cp_linattn.cp.comm import all_gather_tensor, host_group
from cp_linattn.cp.context import FLACPContext, check_cp_call
from cp_linattn.ops.utils import Dims, check_inputs, check_kernel_dtype

RECORD_BYTES = 1024
_ERRORS = {"TypeError": TypeError, "ValueError": ValueError}

Result = TypeVar("Result")
Signature = dict[str, object]


def _encode(record: dict) -> torch.Tensor:
    """The record as a zero-padded uint8 `[RECORD_BYTES]` tensor. Past that size a long error
    message is cut, then the signature's values are replaced by their digests (still
    compared exactly, named in a mismatch by entry only)."""
    data = json.dumps(record).encode()
    if len(data) > RECORD_BYTES and record["error"] is not None:
        keep = max(0, len(record["error"]) - (len(data) - RECORD_BYTES + 3))
        record = dict(record, error=record["error"][:keep] + "...")
        data = json.dumps(record).encode()
    if len(data) > RECORD_BYTES:
        digests = {name: hashlib.blake2b(value.encode(), digest_size=6).hexdigest()
                   for name, value in record["sig"].items()}
        data = json.dumps(dict(record, sig=digests)).encode()
    if len(data) > RECORD_BYTES:
        raise ValueError(f"the call's signature has too many entries for the {RECORD_BYTES}-byte record")
    buf = torch.zeros(RECORD_BYTES, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf


def _decode(row: torch.Tensor) -> dict:
    data = row.numpy().tobytes().rstrip(b"\0")
    return json.loads(data.decode())


def check_on_every_rank(op: str, context: FLACPContext,
                        check: Callable[[], tuple[Result, Signature]]) -> Result:
    """Run `check()` (this rank's argument checks, returning its result and the call's
    signature) and agree on the verdict with every rank of `context.group`.

    Raises on every rank, with one message: the TypeError/ValueError of a rank whose check
    failed (naming that rank), or a ValueError naming the first signature entry on which
    the ranks differ and each rank's value. A collective: every rank must call it.
    """
    result, signature = None, {}
    record = {"error": None, "type": None, "sig": {}}
    try:
        result, signature = check()
        record["sig"] = {name: repr(value) for name, value in signature.items()}
    except (TypeError, ValueError) as e:
        record.update(error=str(e), type=type(e).__name__)
    own = _encode(record)
    rows = all_gather_tensor(own, host_group(context.group))  # blocks the host only
    if record["error"] is None and bool((rows == own).all()):
        return result  # the common case: every rank sent this very record
    records = [_decode(row) for row in rows]
    where = f"{op} under cp_context"
    for r, other in enumerate(records):
        if other["error"] is not None:
            raise _ERRORS.get(other["type"], ValueError)(
                f"{where}: rank {r} of {context.world_size} rejected its arguments: {other['error']}")
    for name, value in records[0]["sig"].items():
        values = [other["sig"].get(name) for other in records]
        if any(v != value for v in values):
            per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            odd = [r for r, v in enumerate(values) if values.count(v) < max(values.count(u) for u in values)]
            fault = f"; rank {', '.join(map(str, odd))} differ{'s' if len(odd) == 1 else ''} from the others" \
                if odd else ""
            raise ValueError(f"{where}: {name} must be the same on every rank of the group, got {per_rank}{fault}")
    return result


def checked_call(op: str, context: FLACPContext | None, check: Callable[[], Result],
                 signature: Callable[[Result], Signature]) -> Result:
    """`check()` alone without CP; under CP `check_on_every_rank`, with `signature(result)`
    the entries every rank must agree on."""
    if context is None:
        return check()
    if not isinstance(context, FLACPContext):
        raise TypeError(f"cp_context must be an FLACPContext (from build_cp_context), got {type(context).__name__}")

    def local() -> tuple[Result, Signature]:
        result = check()
        return result, signature(result)

    return check_on_every_rank(op, context, local)


def check_op_inputs(q, k, v, g, beta=None, *, initial_state, cu_seqlens, cu_seqlens_cpu,
                    cp_context: FLACPContext | None, **options) -> Dims:
    """`check_inputs` of an op's tensors, under CP first `check_cp_call` (the local shard, the
    context's offsets, `initial_state` over the global sequences); `options` go to
    `check_inputs`."""
    num_states = None
    if cp_context is not None:
        cu_seqlens = check_cp_call(cp_context, cu_seqlens, cu_seqlens_cpu, q=q, k=k, v=v, g=g,
                                   **({} if beta is None else {"beta": beta}))
        cu_seqlens_cpu, num_states = cp_context.cu_seqlens_cpu, cp_context.global_num_seqs
    dims = check_inputs(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                        cu_seqlens_cpu=cu_seqlens_cpu, num_states=num_states, **options)
    check_kernel_dtype(q)
    return dims


def call_signature(context: FLACPContext, dims: Dims, q: torch.Tensor, g: torch.Tensor, scale: float,
                   initial_state: torch.Tensor | None, **options) -> Signature:
    """The entries of an op call that every rank must pass alike (the local length differs
    by design and is checked against the context's split by each rank)."""
    return {
        "cp_context (the global batch)": context.batch_signature,
        "q.dtype": q.dtype, "H (q.shape[2])": dims.H, "K (q.shape[3])": dims.K,
        "HV (v.shape[2])": dims.HV, "V (v.shape[3])": dims.V, "g.dtype": g.dtype, "scale": scale,
        "initial_state": None if initial_state is None else (list(initial_state.shape), initial_state.dtype),
        **options,
    }
