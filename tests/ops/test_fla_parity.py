"""Drop-in parity with flash-linear-attention 0.6.0 (GPU, needs `fla` importable).

FLA's chunk_gla / chunk_kda and ours are called with the same arguments, across the keyword
set they share (state_v_first, initial and final states, int32 cu_seqlens with and without
cu_seqlens_cpu, l2norm, the in-kernel gate with A_log / dt_bias, safe_gate / lower_bound,
beta from logits, allow_neg_eigval, disable_recompute, GVA, chunk_size 32), in bf16 at K = V = 128. Both are
compared with the fp32 reference (`ops/*/naive.py`) on the same rounded inputs, output and
every gradient: ours must be no less accurate than FLA's, an RMS error at most 1.5 times
FLA's, or at most 1e-2 of the reference's RMS.
"""
from __future__ import annotations

import pytest
import torch

from cp_linattn import chunk_gla, chunk_kda
from cp_linattn.ops.common.l2norm import l2norm
from cp_linattn.ops.gla.naive import naive_recurrent_gla
from cp_linattn.ops.kda.naive import kda_gate, kda_lower_bound_gate, naive_recurrent_kda
from tests.utils import kda_inputs, rms_rel_err, run_with_grads

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def one_config_per_fla_kernel(monkeypatch):
    """FLA's autotuned kernels run one configuration each (the fewest pipeline stages) instead of
    benchmarking every one: an accuracy comparison needs a valid configuration, not the fastest,
    and autotuning each of FLA's kernels at every shape of these cases takes minutes."""
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs
    monkeypatch.setattr(Autotuner, "prune_configs",
                        lambda self, kwargs: [min(prune(self, kwargs), key=lambda c: c.num_stages)])

RATIO, ABSOLUTE = 1.5, 1e-2
# 16 value heads at K = V = 128, as the Triton cache of FLA's tuned kernels (/work/shared/facts.md)
T, HV, K = 700, 16, 128
OFFSETS = [0, 250, 251, 700]  # no length a multiple of 64, one of length 1


def _turned(x: torch.Tensor | None, state_v_first: bool) -> torch.Tensor | None:
    """A `[..., K, V]` state as the op takes it with state_v_first (and back: the same turn)."""
    return x.transpose(-1, -2).contiguous() if x is not None and state_v_first else x


def _offsets(case: dict) -> dict:
    """cu_seqlens (and cu_seqlens_cpu) of a case: int32 as FLA's tests pass them, or none."""
    if not case.get("varlen"):
        return {}
    kw = dict(cu_seqlens=torch.tensor(OFFSETS, dtype=torch.int32, device="cuda"))
    if case.get("cpu_copy"):
        kw["cu_seqlens_cpu"] = torch.tensor(OFFSETS, dtype=torch.int32)
    return kw


def _compare(name: str, ours, fla, reference, inputs: dict, do: torch.Tensor, dht: torch.Tensor) -> None:
    """Runs the three on `inputs` (bf16 for ours and FLA's, fp32 for the reference) with the
    same cotangents and checks every output and gradient (`RATIO`, `ABSOLUTE`)."""
    got = run_with_grads(ours, inputs, do, dht)
    theirs = run_with_grads(fla, inputs, do, dht)
    want = run_with_grads(reference, {n: None if x is None else x.float() for n, x in inputs.items()}, do, dht)
    failures = []
    for key, ref in want.items():
        ours_err, fla_err = rms_rel_err(got[key], ref), rms_rel_err(theirs[key], ref)
        print(f"{name} {key}: ours {ours_err:.2e}  FLA {fla_err:.2e}")
        if not (torch.isfinite(got[key]).all() and ours_err <= max(RATIO * fla_err, ABSOLUTE)):
            failures.append(f"{key}: ours {ours_err:.3e} vs FLA {fla_err:.3e}")
    assert not failures, f"{name}: less accurate than FLA: {failures}"


GLA_CASES = {
    "dense": dict(),
    "varlen-int32": dict(varlen=True),
    "varlen-int32-cpu-copy-v-first": dict(varlen=True, cpu_copy=True, state_v_first=True),
    "dense-v-first": dict(state_v_first=True),
}


@pytest.mark.parametrize("case", GLA_CASES)
def test_chunk_gla_as_accurate_as_fla(case):
    fla_chunk_gla = pytest.importorskip("fla.ops.gla", reason="needs flash-linear-attention").chunk_gla
    opts = GLA_CASES[case]
    kw, v_first = _offsets(opts), opts.get("state_v_first", False)
    inp = kda_inputs(T=T, H=HV, HV=HV, K=K, V=K, N=3 if opts.get("varlen") else None, gate="log", gate_scale=2.0,
                     device="cuda", dtype=torch.bfloat16)
    inputs = {n: inp[n] for n in ("q", "k", "v", "g", "h0")}
    gen = torch.Generator().manual_seed(11)
    do = torch.randn(*inp["v"].shape, generator=gen).cuda()
    dht = torch.randn(*inp["h0"].shape, generator=gen).cuda()

    def op(fn):
        def call(q, k, v, g, h0):
            o, ht = fn(q, k, v, g, initial_state=_turned(h0, v_first), output_final_state=True,
                       state_v_first=v_first, **kw)
            return o, _turned(ht, v_first)
        return call

    def reference(q, k, v, g, h0):
        return naive_recurrent_gla(q, k, v, g, initial_state=h0, output_final_state=True,
                                   cu_seqlens=kw.get("cu_seqlens"))

    _compare(f"chunk_gla[{case}]", op(chunk_gla), op(fla_chunk_gla), reference, inputs, do, dht)


KDA_CASES = {
    "varlen-int32": dict(varlen=True),
    "varlen-int32-cpu-copy-v-first": dict(varlen=True, cpu_copy=True, state_v_first=True),
    "l2norm-gate-A_log-dt_bias-gva": dict(varlen=True, l2=True, gate="softplus", gva=2),
    "safe-gate-lower-bound": dict(varlen=True, cpu_copy=True, l2=True, gate="lower_bound"),
    "beta-logits": dict(varlen=True, l2=True, beta_logits=True),
    "beta-logits-neg-eigval-gva": dict(l2=True, beta_logits=True, allow_neg_eigval=True, gva=2),
    "disable-recompute-gate-v-first": dict(varlen=True, l2=True, gate="softplus", disable_recompute=True,
                                           state_v_first=True),
    "chunk-size-32-gate-gva": dict(varlen=True, l2=True, gate="softplus", gva=2, chunk_size=32),
}


def _kda_options(opts: dict) -> dict:
    """The chunk_kda keywords of a case (the same for ours and FLA's)."""
    kw = dict(use_qk_l2norm_in_kernel=opts.get("l2", False), use_gate_in_kernel="gate" in opts,
              use_beta_sigmoid_in_kernel=opts.get("beta_logits", False),
              allow_neg_eigval=opts.get("allow_neg_eigval", False),
              disable_recompute=opts.get("disable_recompute", False), state_v_first=opts.get("state_v_first", False),
              chunk_size=opts.get("chunk_size", 64))
    if opts.get("gate") == "lower_bound":
        kw.update(safe_gate=True, lower_bound=-5.0)
    return kw


@pytest.mark.parametrize("case", KDA_CASES)
def test_chunk_kda_as_accurate_as_fla(case):
    fla_chunk_kda = pytest.importorskip("fla.ops.kda", reason="needs flash-linear-attention").chunk_kda
    opts = KDA_CASES[case]
    kw, options = _offsets(opts), _kda_options(opts)
    v_first, gated = options["state_v_first"], options["use_gate_in_kernel"]
    inp = kda_inputs(T=T, H=HV // opts.get("gva", 1), HV=HV, K=K, V=K, N=3 if opts.get("varlen") else None,
                     gate="raw" if gated else "log", gate_scale=1.0, normalise_k=not options["use_qk_l2norm_in_kernel"],
                     device="cuda", dtype=torch.bfloat16)
    if options["use_beta_sigmoid_in_kernel"]:
        inp["beta"] = (2 * torch.randn(*inp["beta"].shape, generator=torch.Generator().manual_seed(3))).to(
            device="cuda", dtype=torch.bfloat16)
    names = ["q", "k", "v", "g", "beta", "h0"] + (["A_log", "dt_bias"] if gated else [])
    inputs = {n: inp[n] for n in names}
    gen = torch.Generator().manual_seed(11)
    do = torch.randn(*inp["v"].shape, generator=gen).cuda()
    dht = torch.randn(*inp["h0"].shape, generator=gen).cuda()

    def op(fn):
        def call(q, k, v, g, beta, h0, A_log=None, dt_bias=None):
            gate = dict(A_log=A_log, dt_bias=dt_bias) if gated else {}
            o, ht = fn(q, k, v, g, beta, initial_state=_turned(h0, v_first), output_final_state=True, **options,
                       **kw, **gate)
            return o, _turned(ht, v_first)
        return call

    def reference(q, k, v, g, beta, h0, A_log=None, dt_bias=None):
        if options["use_qk_l2norm_in_kernel"]:
            q, k = l2norm(q), l2norm(k)
        if gated:
            g = kda_lower_bound_gate(g, A_log, dt_bias, options["lower_bound"]) if "lower_bound" in options \
                else kda_gate(g, A_log, dt_bias)
        return naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                   cu_seqlens=kw.get("cu_seqlens"),
                                   use_beta_sigmoid_in_kernel=options["use_beta_sigmoid_in_kernel"],
                                   allow_neg_eigval=options["allow_neg_eigval"])

    _compare(f"chunk_kda[{case}]", op(chunk_kda), op(fla_chunk_kda), reference, inputs, do, dht)
