"""Context parallelism at FLA's import path (`fla.ops.cp`): `build_cp_context` and `FLACPContext`
re-exported from `cp_linattn.cp`, where they live (cp/ builds on ops/; nothing in ops/ imports
this module, so it adds no import cycle)."""
from cp_linattn.cp import FLACPContext, build_cp_context

__all__ = ["FLACPContext", "build_cp_context"]
