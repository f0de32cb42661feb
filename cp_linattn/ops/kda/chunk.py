"""`chunk_kda`: chunked Kimi Delta Attention (forward `chunk_kda_fwd`, backward `chunk_kda_bwd`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cp_linattn.cp.context import FLACPContext
from cp_linattn.cp.guard import call_signature, check_op_inputs, checked_call
from cp_linattn.cp.exchange import CPExchange
from cp_linattn.ops.common.l2norm import l2norm_bwd, l2norm_fwd
from cp_linattn.ops.kda.chunk_bwd import chunk_kda_bwd
from cp_linattn.ops.kda.chunk_fwd import ChunkKDAIntra, KDAGate, chunk_kda_fwd
from cp_linattn.ops.kda.gate import beta_sigmoid, beta_sigmoid_bwd
from cp_linattn.ops.kda.wy import CHUNK_SIZE, CHUNK_SIZES
from cp_linattn.ops.utils import (check_flag, check_scale, check_tensor, kernel_state, prepare_varlen_chunks,
                                  refuse_double_backward, save_for_backward, saved_tensors, transpose_state)

MAX_HEAD_DIM = 256
SAFE_LOWER_BOUND = -5.0


@dataclass
class ChunkKDASaved:
    """What the forward keeps for the backward. Always: the inputs (beta as the kernels ran
    with it: from logits, the fp32 sigmoid, which its backward reads too), the states h (the state
    pass is the sequential one, costly to redo; fp32, as the gate gradient's rowsum(h * dh)
    cancels), v_new, and `intra`'s gk with its exact blocks, Aqk, Akk (a pass over g saved, for
    T * HV * K * 4 bytes). With disable_recompute also w, qg, kg and the normalised q, k
    (None otherwise: the backward rebuilds them)."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    chunk_indices: torch.Tensor | None
    chunk_offsets: torch.Tensor | None
    h: torch.Tensor
    v_new: torch.Tensor
    gk: torch.Tensor
    exact_blocks: torch.Tensor
    Aqk: torch.Tensor
    Akk: torch.Tensor
    w: torch.Tensor | None
    qg: torch.Tensor | None
    kg: torch.Tensor | None
    q_normed: torch.Tensor | None
    k_normed: torch.Tensor | None

    def intra(self) -> ChunkKDAIntra:
        return ChunkKDAIntra(gk=self.gk, exact_blocks=self.exact_blocks, w=self.w, u=None, qg=self.qg, kg=self.kg,
                             Aqk=self.Aqk, Akk=self.Akk)


@dataclass(frozen=True)
class ChunkKDAOptions:
    """The validated non-tensor arguments of a call (the backward reads them too)."""
    scale: float
    output_final_state: bool
    use_qk_l2norm_in_kernel: bool
    use_gate_in_kernel: bool
    lower_bound: float | None
    beta_scale: float | None  # use_beta_sigmoid_in_kernel: beta = beta_scale * sigmoid(beta); else None
    disable_recompute: bool
    state_v_first: bool
    chunk_size: int


@dataclass
class ChunkKDARun:
    """What one forward computes: the outputs, and what the backward (or the inference caller)
    reads. beta is the step size the kernels ran with (fp32 when formed from logits)."""
    o: torch.Tensor
    final_state: torch.Tensor | None
    intra: ChunkKDAIntra
    h: torch.Tensor
    v_new: torch.Tensor
    exchange: CPExchange | None
    qn: torch.Tensor
    kn: torch.Tensor
    beta: torch.Tensor
    chunk_indices: torch.Tensor | None
    chunk_offsets: torch.Tensor | None


def chunk_kda_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, opt: ChunkKDAOptions, cu_seqlens,
                      cu_seqlens_cpu, cp_context) -> ChunkKDARun:
    """The forward of `chunk_kda` on validated inputs: varlen tables, l2norm, beta from logits,
    the gate, the chunked kernels (`chunk_kda_fwd`). Shared by the autograd Function and the
    inference path (`return_intermediate_states`)."""
    chunk_indices = chunk_offsets = None
    if cu_seqlens is not None:
        chunk_indices, chunk_offsets = prepare_varlen_chunks(cu_seqlens, cu_seqlens_cpu, opt.chunk_size)
    qn, kn = (l2norm_fwd(q), l2norm_fwd(k)) if opt.use_qk_l2norm_in_kernel else (q, k)
    if opt.beta_scale is not None:
        beta = beta_sigmoid(beta, opt.beta_scale)
    gate = KDAGate(A_log, dt_bias, opt.lower_bound) if opt.use_gate_in_kernel else None
    o, final_state, intra, h, v_new, exchange = chunk_kda_fwd(
        qn, kn, v, g, beta, opt.scale, initial_state=initial_state, output_final_state=opt.output_final_state,
        gate=gate, state_v_first=opt.state_v_first, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
        chunk_offsets=chunk_offsets, cp_context=cp_context, chunk_size=opt.chunk_size,
    )
    return ChunkKDARun(o, final_state, intra, h, v_new, exchange, qn, kn, beta, chunk_indices, chunk_offsets)


class ChunkKDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, opt: ChunkKDAOptions, cu_seqlens,
                cu_seqlens_cpu, cp_context):
        run = chunk_kda_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, opt, cu_seqlens, cu_seqlens_cpu,
                                cp_context)
        keep = opt.disable_recompute
        normed = keep and opt.use_qk_l2norm_in_kernel
        intra = run.intra
        save_for_backward(ctx, ChunkKDASaved(
            q, k, v, g, run.beta, A_log, dt_bias, cu_seqlens, run.chunk_indices, run.chunk_offsets, run.h, run.v_new,
            intra.gk, intra.exact_blocks, intra.Aqk, intra.Akk, intra.w if keep else None, intra.qg if keep else None,
            intra.kg if keep else None, run.qn if normed else None, run.kn if normed else None))
        ctx.options = opt
        ctx.exchange = run.exchange
        ctx.h0_dtype = None if initial_state is None else initial_state.dtype
        ctx.beta_dtype = beta.dtype
        return run.o, run.final_state

    @staticmethod
    def backward(ctx, do, dht):
        refuse_double_backward("chunk_kda")
        saved: ChunkKDASaved = saved_tensors(ctx)
        opt: ChunkKDAOptions = ctx.options
        qn, kn = saved.q, saved.k
        if opt.use_qk_l2norm_in_kernel:
            qn, kn = (saved.q_normed, saved.k_normed) if saved.q_normed is not None else \
                (l2norm_fwd(saved.q), l2norm_fwd(saved.k))
        # The kernels write every gradient in its input's dtype; dq, dk stay fp32 when the
        # l2norm backward (fp32 math, q's / k's dtype out) consumes them.
        gate = KDAGate(saved.A_log, saved.dt_bias, opt.lower_bound) if opt.use_gate_in_kernel else None
        dq, dk, dv, dbeta, dg, dh0, dA_log, ddt_bias = chunk_kda_bwd(
            qn, kn, saved.v, saved.g, saved.beta, opt.scale, do, dht=dht, need_dh0=ctx.h0_dtype is not None,
            intra=saved.intra(), h=saved.h, v_new=saved.v_new, gate=gate, state_v_first=opt.state_v_first,
            cu_seqlens=saved.cu_seqlens, chunk_indices=saved.chunk_indices, chunk_offsets=saved.chunk_offsets,
            exchange=ctx.exchange,
            dqk_dtype=torch.float32 if opt.use_qk_l2norm_in_kernel else saved.q.dtype,
        )
        if dh0 is not None:
            dh0 = dh0.to(ctx.h0_dtype)
        if opt.use_qk_l2norm_in_kernel:
            dq, dk = l2norm_bwd(saved.q, dq), l2norm_bwd(saved.k, dk)
        if opt.beta_scale is not None:
            dbeta = beta_sigmoid_bwd(saved.beta, dbeta, opt.beta_scale, ctx.beta_dtype)
        return dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0, None, None, None, None


def _check_kda_options(dims, g, use_gate_in_kernel, A_log, dt_bias, safe_gate, lower_bound) -> None:
    """KDA-specific argument checks (gate parameters, head dims)."""
    if max(dims.K, dims.V) > MAX_HEAD_DIM:
        raise ValueError(f"head dims must be <= {MAX_HEAD_DIM}, got K={dims.K} (q.shape[3]), V={dims.V} (v.shape[3])")
    if lower_bound is not None:
        if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)) \
                or not (math.isfinite(lower_bound) and lower_bound < 0):
            raise ValueError(f"lower_bound must be a negative finite number or None, got {lower_bound!r}")
    if not use_gate_in_kernel:
        for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
            if x is not None:
                raise ValueError(f"{name} is only used with use_gate_in_kernel=True, got a tensor with "
                                 f"use_gate_in_kernel=False")
        return
    if A_log is None and lower_bound is None:
        raise ValueError("A_log must be given when use_gate_in_kernel=True and lower_bound is None, got None")
    if A_log is not None:
        check_tensor("A_log", A_log, device=g.device)
        if A_log.numel() != dims.HV:
            raise ValueError(f"A_log must have HV={dims.HV} elements, got shape {list(A_log.shape)}")
    if dt_bias is not None:
        check_tensor("dt_bias", dt_bias, device=g.device)
        if dt_bias.numel() != dims.HV * dims.K:
            raise ValueError(f"dt_bias must have HV*K={dims.HV * dims.K} elements, got shape {list(dt_bias.shape)}")
    if safe_gate:
        if lower_bound is None:
            raise ValueError("lower_bound must be given when safe_gate=True and use_gate_in_kernel=True, got None")
        if not SAFE_LOWER_BOUND <= lower_bound < 0:
            raise ValueError(f"lower_bound must be in [{SAFE_LOWER_BOUND}, 0) with safe_gate=True, got {lower_bound}")


def _check_fla_options(flags: dict[str, bool], chunk_size, max_num_seqs) -> None:
    """The arguments FLA 0.6.0's chunk_kda has besides the kernels' inputs, checked as FLA
    checks them (its asserts as ValueErrors naming the argument), or refused where we do not
    implement them."""
    if flags["allow_neg_eigval"] and not flags["use_beta_sigmoid_in_kernel"]:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True (beta = 2 * sigmoid(beta) "
                         "from logits, as in FLA), got use_beta_sigmoid_in_kernel=False")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__} {chunk_size!r}")
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be 32 or 64 (as in FLA), got {chunk_size}")
    if flags["use_graph"]:
        raise ValueError(
            "use_graph=True is not supported: FLA's graph mode (a fixed-size chunk list rebuilt on the device, so "
            "that replays may change the contents of cu_seqlens) is not implemented. Pass use_graph=False: with "
            "cu_seqlens_cpu given (or without cu_seqlens) chunk_kda makes no host sync, so its forward and backward "
            "can be captured in a CUDA graph as they are, after one eager call with the same cu_seqlens tensor; "
            "replays must keep the offsets the graph was captured with")
    if max_num_seqs is not None:
        raise ValueError(f"max_num_seqs is only used with use_graph=True, which is not supported; pass None, got "
                         f"{max_num_seqs!r}")
    if flags["return_intermediate_states"]:
        if not torch.is_inference_mode_enabled():
            raise ValueError("return_intermediate_states=True is only allowed in inference mode (it bypasses "
                             "autograd): call chunk_kda under torch.inference_mode()")
        if flags["disable_recompute"]:
            raise ValueError("return_intermediate_states=True must be used with disable_recompute=False, got "
                             "disable_recompute=True")


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    cp_context: FLACPContext | None = None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    *,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    r"""Kimi Delta Attention, chunked: `S_t = (I - b_t k_t k_t^T) Diag(exp g_t) S_{t-1} + b_t k_t v_t^T`,
    `o_t = scale * S_t^T q_t`. Keyword and position compatible with `fla.ops.kda.chunk_kda`
    (FLA 0.6.0; A_log, dt_bias and chunk_size are keyword-only there too).

    Args:
        q, k: `[B, T, H, K]`; v: `[B, T, HV, V]` with HV a multiple of H (GVA: value head j
            reads q/k head j // (HV / H)); fp32, fp16 or bf16, one dtype. K, V <= 256.
        g: `[B, T, HV, K]` log-space (natural log) per-channel decay, <= 0; with
            `use_gate_in_kernel` the raw gate input instead.
        beta: `[B, T, HV]` delta-rule step sizes (post-sigmoid), or their logits with
            `use_beta_sigmoid_in_kernel`.
        scale: defaults to K ** -0.5.
        initial_state: `[N, HV, K, V]` (`[N, HV, V, K]` with `state_v_first`), read as fp32.
        output_final_state: also return the fp32 final states (same layout).
        use_qk_l2norm_in_kernel: L2-normalise q and k over K (eps 1e-6) inside the op.
        use_gate_in_kernel: g is raw; the decay is `-exp(A_log) * softplus(g + dt_bias)`, or with
            `lower_bound` `lower_bound * sigmoid(exp(A_log) * (g + dt_bias))` (A_log may then
            be None: `lower_bound * sigmoid(g + dt_bias)`). A_log `[HV]`, dt_bias `[HV * K]`.
        use_beta_sigmoid_in_kernel: beta holds logits; the op runs with `sigmoid(beta)` (fp32)
            and returns the logits' gradient.
        allow_neg_eigval: with `use_beta_sigmoid_in_kernel` (required, as in FLA), the step sizes
            are `2 * sigmoid(beta)`, in (0, 2): `I - beta k k^T` may reflect (eigenvalue down to -1).
        safe_gate: with the in-kernel gate, requires `lower_bound` in [-5, 0). The kernels
            always use the exact overflow-free path (see `ops/kda/wy.py`), so this only
            validates; without the in-kernel gate it has no effect.
        disable_recompute: keep w, qg, kg (and the normalised q, k) for the backward
            instead of recomputing them: more memory, identical gradients. The states h (fp32),
            v_new and the fp32 gate cumsum gk are kept in either case (h: `NT * HV * K * V`
            fp32, 512 MiB per call at T=32768, HV=16, K=V=128), which saves the backward a
            second state pass and a pass over g.
        return_intermediate_states: for inference (under `torch.inference_mode()`, with
            disable_recompute=False, as FLA asserts): also return the states entering every
            chunk, h `[B, NT, HV, K, V]` (`[B, NT, HV, V, K]` with `state_v_first`) in k's dtype,
            NT = cdiv(T, chunk_size) per row, or every chunk of the packed batch with cu_seqlens (B = 1).
        state_v_first: states stored `[V, K]` per head.
        cu_seqlens: int32 or int64 `[N + 1]` offsets of a packed batch (B == 1).
        cu_seqlens_cpu: the same offsets on the CPU (int32 or int64), to spare the one
            device-to-host read of cu_seqlens. Without it that read happens once per cu_seqlens
            tensor (and again after an in-place change of it), not once per call: the layers of a
            model share it. With it, or without cu_seqlens, forward and backward make no
            device-to-host copy (tests/ops/test_host_sync.py).
        cp_context: context parallelism (`cp_linattn.cp.build_cp_context`): every tensor
            argument is this rank's shard `[1, T_local, ...]` of the global packed batch (its
            tokens in the context's layout) and
            the result is exactly this rank's slice of the single-rank result, for every option.
            `cu_seqlens` comes from the context (if given it must be the global offsets).
            `initial_state` is `[N_global, HV, K, V]` (same on every rank), each row used on the
            rank where its sequence starts, its gradient holding those rows (sum over the group
            = full gradient); the final state is `[N_global, ...]` with the rows of the sequences
            that END on this rank and zeros elsewhere (sum over the group = every final state).
            A collective: every rank of the group calls it.
        use_graph, max_num_seqs: FLA's graph mode; only use_graph=False / max_num_seqs=None are
            accepted (capture the op as it is instead: see the ValueError for use_graph=True).
        A_log, dt_bias: the in-kernel gate's parameters (keyword-only).
        chunk_size: tokens per chunk, 64 or 32 (keyword-only, as in FLA). Same results up to
            rounding; 64 is faster, 32 has smaller per-chunk matrices (FLA's choice for some
            inference shapes). Other values raise ValueError.

    Numerics: the delta rule is only stable when `beta_t * |k_t|^2 <= 2` (each update
    `I - beta k k^T` must be a contraction); with beta near 1 that needs L2-normalised keys.
    Pass normalised k or set `use_qk_l2norm_in_kernel=True`: with large unnormalised keys the
    states (and the `(I + Akk)^-1` of each chunk) grow exponentially and overflow. Gates of
    any strength are safe: an exponent of a gate difference is either <= 0 or, on the
    tensor-core path of the diagonal sub-blocks, bounded by a run-time check of the gates' span.

    Returns:
        o `[B, T, HV, V]` in v's dtype and the final state (fp32) or None; with
        return_intermediate_states also h (see above).
    """
    def check():
        if not isinstance(beta, torch.Tensor):
            raise TypeError(f"beta must be a torch.Tensor of shape [B, T, HV] (the delta-rule step sizes), "
                            f"got {type(beta).__name__}")
        flags = {name: check_flag(name, value) for name, value in (
            ("output_final_state", output_final_state), ("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel),
            ("use_gate_in_kernel", use_gate_in_kernel), ("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel),
            ("allow_neg_eigval", allow_neg_eigval), ("safe_gate", safe_gate),
            ("disable_recompute", disable_recompute), ("return_intermediate_states", return_intermediate_states),
            ("state_v_first", state_v_first), ("use_graph", use_graph))}
        _check_fla_options(flags, chunk_size, max_num_seqs)
        dims = check_op_inputs(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                               cu_seqlens_cpu=cu_seqlens_cpu, cp_context=cp_context, allow_gva=True,
                               state_v_first=state_v_first)
        _check_kda_options(dims, g, use_gate_in_kernel, A_log, dt_bias, safe_gate, lower_bound)
        bound = None if not use_gate_in_kernel or lower_bound is None else float(lower_bound)
        return dims, check_scale(scale, dims.K), flags, bound

    dims, scale_, flags, bound = checked_call(
        "chunk_kda", cp_context, check,
        lambda call: call_signature(cp_context, call[0], q, g, call[1], initial_state, lower_bound=call[3],
                                    A_log=None if A_log is None else list(A_log.shape),
                                    dt_bias=None if dt_bias is None else list(dt_bias.shape), chunk_size=chunk_size,
                                    **call[2]))
    opt = ChunkKDAOptions(
        scale=scale_, output_final_state=flags["output_final_state"],
        use_qk_l2norm_in_kernel=flags["use_qk_l2norm_in_kernel"], use_gate_in_kernel=flags["use_gate_in_kernel"],
        lower_bound=bound, beta_scale=(2.0 if flags["allow_neg_eigval"] else 1.0)
        if flags["use_beta_sigmoid_in_kernel"] else None,
        disable_recompute=flags["disable_recompute"], state_v_first=flags["state_v_first"], chunk_size=chunk_size)
    args = (q, k, v, g, beta, A_log, dt_bias, kernel_state(initial_state), opt, dims.cu_seqlens, dims.cu_seqlens_cpu,
            cp_context)
    if flags["return_intermediate_states"]:
        run = chunk_kda_forward(*args)
        # FLA's contract: h in k's dtype, laid out as the states
        h = transpose_state(run.h.to(k.dtype), opt.state_v_first)
        return run.o, run.final_state, h
    return ChunkKDAFunction.apply(*args)
