"""A stand-in for FLA 0.6.0's `fla.ops.kda` / `fla.ops.gla` in sys.modules (FLA is not needed
on the CPU): its chunk_kda / chunk_gla accept only the keywords FLA 0.6.0's do (chunk_kda also
the **kwargs it reads: the others it would silently drop), record each call and return our
op's result."""
from __future__ import annotations

import sys
import types

from cp_linattn.ops.gla.chunk import chunk_gla
from cp_linattn.ops.kda.chunk import chunk_kda

# FLA 0.6.0's parameters after the positional tensors (/fla/ops/{kda,gla}/chunk.py)
FLA_KEYWORDS = {
    "chunk_kda": ("scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
                  "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "safe_gate", "lower_bound", "disable_recompute",
                  "return_intermediate_states", "state_v_first", "cu_seqlens", "cu_seqlens_cpu", "cp_context",
                  "use_graph", "max_num_seqs", "A_log", "dt_bias", "chunk_size", "transpose_state_layout"),
    "chunk_gla": ("scale", "initial_state", "output_final_state", "state_v_first", "cu_seqlens", "cu_seqlens_cpu"),
}
POSITIONAL = {"chunk_kda": 5, "chunk_gla": 4}  # q, k, v, g (, beta)


def install_fake_fla(monkeypatch, version: str = "0.6.0") -> list[tuple[str, tuple, dict]]:
    """Put fake `fla`, `fla.ops`, `fla.ops.kda`, `fla.ops.gla` (fla.__version__ = version) in
    sys.modules for the test; returns the list each call appends `(name, args, kwargs)` to."""
    calls: list[tuple[str, tuple, dict]] = []

    def fake(name, ours):
        def op(*args, **kwargs):
            unknown = set(kwargs) - set(FLA_KEYWORDS[name])
            if unknown or len(args) > POSITIONAL[name]:
                raise TypeError(f"FLA 0.6.0's {name} does not take {sorted(unknown)} / {len(args)} positionals")
            calls.append((name, args, kwargs))
            return ours(*args, **kwargs)
        return op

    fla = types.ModuleType("fla")
    fla.__version__, fla.__path__ = version, []
    ops = types.ModuleType("fla.ops")
    ops.__path__ = []
    kda, gla = types.ModuleType("fla.ops.kda"), types.ModuleType("fla.ops.gla")
    kda.chunk_kda, gla.chunk_gla = fake("chunk_kda", chunk_kda), fake("chunk_gla", chunk_gla)
    fla.ops, ops.kda, ops.gla = ops, kda, gla
    for module in (fla, ops, kda, gla):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    return calls
