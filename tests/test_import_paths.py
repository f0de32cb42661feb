"""The public ops at the import paths FLA users already have in code (`fla.ops.gla`,
`fla.ops.kda`, `fla.ops.cp`) under `cp_linattn.ops.*` / `cp_linattn.cp`."""
import cp_linattn


def test_ops_are_exported_where_fla_keeps_them():
    from cp_linattn.cp import FLACPContext, build_cp_context
    from cp_linattn.ops.gla import chunk_gla, fused_chunk_gla
    from cp_linattn.ops.kda import chunk_kda

    assert (chunk_gla, fused_chunk_gla, chunk_kda) == (cp_linattn.chunk_gla, cp_linattn.fused_chunk_gla,
                                                       cp_linattn.chunk_kda)
    assert (build_cp_context, FLACPContext) == (cp_linattn.build_cp_context, cp_linattn.FLACPContext)
