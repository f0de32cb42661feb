"""Context parallelism: sharding metadata (`context`) and boundary-state transports (`comm`).

Design (roles, merge, transports, states, halo, per-call agreement, precision): cp/README.md.
"""
from cp_linattn.cp.comm import all_gather_tensor, send_recv_chain
from cp_linattn.cp.context import CPPart, FLACPContext, build_cp_context, default_split, layout_ranges, shard, unshard

__all__ = ["FLACPContext", "CPPart", "build_cp_context", "layout_ranges", "default_split", "shard", "unshard",
           "all_gather_tensor", "send_recv_chain"]
