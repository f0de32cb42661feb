"""One naming scheme from a profiler trace to the launch settings: a kernel
`<op>_<fwd|bwd>_kernel_<what>` (a launch of the exact diagonal path: `..._exact`) is launched by
`<op>_<fwd|bwd>_<what>`, whose entry in `ops/launch.py`'s LAUNCH holds its settings."""
import re
from pathlib import Path

import pytest
import torch

import cp_linattn
from cp_linattn.ops.launch import LAUNCH

PACKAGE = Path(cp_linattn.__file__).parent
SOURCES = {p: p.read_text() for p in PACKAGE.rglob("*.py")}


def launcher_of(kernel: str) -> str:
    """`chunk_gla_fwd_kernel_o_exact` -> `chunk_gla_fwd_o_exact`; `x_kernel` -> `x`."""
    return kernel.replace("_kernel_", "_") if "_kernel_" in kernel else kernel.removesuffix("_kernel")


def _defined(pattern: str) -> set[str]:
    return {m for text in SOURCES.values() for m in re.findall(pattern, text, flags=re.M)}


# every @triton.jit function named *_kernel* is launched from the host; the others are helpers
KERNELS = {k for k in _defined(r"^@(?:triton\.jit|jit_traced_as\([^)]*\))\ndef (\w+)\(") if "_kernel" in k}
TRACE_ALIASES = _defined(r'^@jit_traced_as\("\w+", "(\w+)"\)')
FUNCTIONS = _defined(r"^def (\w+)\(")


def test_every_kernel_name_leads_to_its_launch_entry():
    kernels = KERNELS | TRACE_ALIASES
    assert len(kernels) >= 20, sorted(kernels)
    missing = sorted(k for k in kernels if launcher_of(k) not in LAUNCH)
    assert not missing, f"kernels without a LAUNCH entry named after their launcher: {missing}"


def test_every_launch_entry_names_a_launcher():
    orphans = sorted(key for key in LAUNCH if key.removesuffix("_exact") not in FUNCTIONS)
    assert not orphans, f"LAUNCH keys that are no launcher's name: {orphans}"


@pytest.mark.gpu
def test_profiler_trace_names_lead_to_launch_entries():
    """The two launches of a kernel show under two names in a trace, and every name of ours
    leads to a LAUNCH entry."""
    from torch.profiler import ProfilerActivity, profile

    from cp_linattn import chunk_gla, chunk_kda

    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    T, H, K = 200, 2, 64
    q, k, v = (torch.randn(1, T, H, K, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
    g = (-torch.rand(1, T, H, K, device=dev) * 0.1).to(dt).requires_grad_(True)
    beta = torch.rand(1, T, H, device=dev, dtype=dt, requires_grad=True)
    A_log = torch.zeros(H, device=dev, requires_grad=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        chunk_gla(q, k, v, g)[0].sum().backward()
        chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                  A_log=A_log)[0].sum().backward()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    ours = {n for n in names if n in KERNELS | TRACE_ALIASES}
    expected = {
        "chunk_fwd_kernel_h", "chunk_bwd_kernel_dh", "chunk_local_cumsum_kernel",
        "chunk_gla_fwd_kernel_o", "chunk_gla_fwd_kernel_o_exact", "chunk_gla_bwd_kernel_dv",
        "chunk_gla_bwd_kernel_dqkg", "chunk_gla_bwd_kernel_dqkg_exact",
        "l2norm_fwd_kernel", "l2norm_bwd_kernel", "kda_gate_fwd_kernel_cumsum", "kda_gate_bwd_kernel_cumsum",
        "chunk_kda_fwd_kernel_intra", "chunk_kda_fwd_kernel_intra_exact", "chunk_delta_rule_fwd_kernel_h",
        "chunk_kda_fwd_kernel_o", "chunk_kda_bwd_kernel_dAv", "chunk_delta_rule_bwd_kernel_dhu",
        "chunk_kda_bwd_kernel_wy_dqkg", "chunk_kda_bwd_kernel_intra", "chunk_kda_bwd_kernel_intra_exact",
    }
    assert expected <= ours, f"missing from the trace: {sorted(expected - ours)}; trace: {sorted(names)}"
    assert all(launcher_of(n) in LAUNCH for n in ours)
