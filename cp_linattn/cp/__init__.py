"""Context parallelism: sharding metadata (`context`) and boundary-state transports (`comm`).

Design (roles, merge, transports, states, halo, per-call agreement, precision): cp/README.md.
"""
from cp_linattn.cp.comm import all_gather_tensor, send_recv_chain
from cp_linattn.cp.context import FLACPContext, build_cp_context, default_split, shard, unshard

__all__ = ["FLACPContext", "build_cp_context", "default_split", "shard", "unshard", "all_gather_tensor", "send_recv_chain"]
