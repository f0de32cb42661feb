"""The public ops at the import paths FLA users already have in code (`fla.ops.gla`,
`fla.ops.kda`, `fla.ops.cp`) under `cp_linattn.ops.*` / `cp_linattn.cp`, with FLA 0.6.0's
parameters in FLA's positions."""
import inspect
import subprocess
import sys

import cp_linattn

# FLA 0.6.0's public signatures, in order (its wheel; /work/shared/facts.md). Its chunk_kda
# takes A_log, dt_bias and chunk_size through **kwargs: keyword-only here.
FLA_CHUNK_GLA = ["q", "k", "v", "g", "scale", "initial_state", "output_final_state", "state_v_first", "cu_seqlens",
                 "cu_seqlens_cpu"]
FLA_CHUNK_KDA = ["q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel",
                 "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "safe_gate", "lower_bound",
                 "disable_recompute", "return_intermediate_states", "state_v_first", "cu_seqlens", "cu_seqlens_cpu",
                 "cp_context", "use_graph", "max_num_seqs"]


def test_ops_are_exported_where_fla_keeps_them():
    from cp_linattn.cp import FLACPContext, build_cp_context
    from cp_linattn.ops.gla import chunk_gla, fused_chunk_gla
    from cp_linattn.ops.kda import chunk_kda

    assert (chunk_gla, fused_chunk_gla, chunk_kda) == (cp_linattn.chunk_gla, cp_linattn.fused_chunk_gla,
                                                       cp_linattn.chunk_kda)
    assert (build_cp_context, FLACPContext) == (cp_linattn.build_cp_context, cp_linattn.FLACPContext)


def test_cp_at_fla_ops_cp_path():
    """`from fla.ops.cp import build_cp_context, FLACPContext` becomes `cp_linattn.ops.cp`; a
    fresh interpreter that imports it first has no import cycle."""
    from cp_linattn.ops.cp import FLACPContext, build_cp_context

    assert (build_cp_context, FLACPContext) == (cp_linattn.build_cp_context, cp_linattn.FLACPContext)
    code = "from cp_linattn.ops.cp import build_cp_context, FLACPContext; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_fla_parameters_in_fla_positions():
    """A call written for FLA, positional arguments included, means the same here; what we add
    (chunk_gla's cp_context) comes after FLA's parameters."""
    gla = list(inspect.signature(cp_linattn.chunk_gla).parameters)
    assert gla[:len(FLA_CHUNK_GLA)] == FLA_CHUNK_GLA
    params = inspect.signature(cp_linattn.chunk_kda).parameters
    positional = [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    keyword_only = {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY}
    assert positional == FLA_CHUNK_KDA
    assert keyword_only == {"A_log", "dt_bias", "chunk_size"}
