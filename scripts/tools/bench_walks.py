"""Time the walks of a KDA middle rank's CP pre-process by column tile, warps and segment count.

A rank that both receives and sends under CP walks its fragment twice before its local
passes: forward on `[u, 0]` from `[0, I]` (`cp_fwd_fragment_h`, V + K columns) and in
reverse for the gradient (`cp_bwd_fragment_dhu`, V columns). Each walk runs one program per
(head, BV columns), stepping through the chunks in turn; cut into S segments walked side by
side (`FragmentSegments`) and folded, it has S times the programs and 1/S of the steps. The
library picks S = SMs // programs, at most 8 (`FragmentSegments.filling`), and BV and warps
from the `fragment_*_walk` entries of `cp_linattn/ops/launch.py`; this sweep shows what
other choices would cost.

Every setting's messages (fp32) are checked against the plain walk (S = 1) at the current
BV (column "max rel diff"; the script fails above 1e-5 for fp32 inputs, 2e-2 for bf16, whose
walks round the state to bf16 for their dots). Timer: `triton.testing.do_bench` median.

From the repository root (scripts/tools/README.md):

    python -m scripts.tools.bench_walks                    # H200: T=8192 (a D=4 rank), HV 16 and 4
    TRITON_INTERPRET=1 python -m scripts.tools.bench_walks --smoke   # CPU: checks only, no timing
"""
from __future__ import annotations

import argparse
import itertools

import torch
from triton.testing import do_bench

from cp_linattn.cp.kda import FragmentSegments, cp_bwd_fragment_dhu, cp_fwd_fragment_h
from cp_linattn.ops.common.chunk_delta_h import delta_state_block_sizes
from cp_linattn.ops.common.cumsum import chunk_local_cumsum
from cp_linattn.ops.kda.wy import CHUNK_SIZE
from cp_linattn.ops.launch import LAUNCH

WALK_KERNELS = ("cp_fwd_fragment_h", "cp_bwd_fragment_dhu")


def fragment(T: int, HV: int, K: int, V: int, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """WY-stage tensors of a `[1, T]` fragment: transitions of norm below 1, chunk-local gates."""
    torch.manual_seed(0)
    gk = chunk_local_cumsum(-torch.rand(1, T, HV, K, device=device) * 0.05, CHUNK_SIZE)
    x = {name: (torch.randn(1, T, HV, K, device=device) * 0.05).to(dtype) for name in ("kg", "w", "qg")}
    x.update({name: torch.randn(1, T, HV, V, device=device).to(dtype) for name in ("u", "do", "dv")})
    return dict(x, gk=gk)


def walks(x: dict[str, torch.Tensor], segments: FragmentSegments):
    """Both messages of the fragment: ((S_ext, M), dS)."""
    state = cp_fwd_fragment_h(x["kg"], x["w"], x["u"], x["gk"], segments)
    return state, cp_bwd_fragment_dhu(x["qg"], x["kg"], x["w"], x["gk"], x["do"], x["dv"], 0.088, segments)


def max_rel_diff(got, ref) -> float:
    """Largest difference of the three messages, each relative to its largest entry."""
    (s, m), d = got
    (s_ref, m_ref), d_ref = ref
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in ((s, s_ref), (m, m_ref), (d, d_ref)))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--T", type=int, default=8192, help="fragment tokens (default 8192; --smoke 300)")
    p.add_argument("--HV", type=int, nargs="+", default=[16, 4], help="value heads (default 16 4; --smoke 2)")
    p.add_argument("--BV", type=int, nargs="+", default=[16, 32, 64],
                   help="column tiles (default 16 32 64; at most 2048 * warps // K: the fp32 state's register budget)")
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8], help="num_warps (default 4 8)")
    p.add_argument("--segments", type=int, nargs="+", default=[1, 2, 4, 8], help="segment counts S")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, fp32, no timing (CPU: TRITON_INTERPRET=1)")
    args = p.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    T, K, V = (300, 16, 32) if args.smoke else (args.T, 128, 128)
    head_counts = [2] if args.smoke else args.HV
    dtype = torch.float32 if args.smoke else torch.bfloat16
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    saved = {name: dict(LAUNCH[name]) for name in WALK_KERNELS}
    print(f"T={T}, K={K}, V={V}, {str(dtype).removeprefix('torch.')}; walk times in us "
          f"(fwd: V + K = {V + K} columns; bwd: {V})")
    print("| HV | BV | warps | S | fwd walk us | bwd walk us | max rel diff |")
    print("|---|---|---|---|---|---|---|")
    try:
        for HV in head_counts:
            x = fragment(T, HV, K, V, device, dtype)
            plain = walks(x, FragmentSegments(T, 1, torch.device(device), CHUNK_SIZE))
            for BV, warps, S in itertools.product(args.BV, args.warps, args.segments):
                for name in WALK_KERNELS:
                    LAUNCH[name].update(BV=BV, num_warps=warps)
                segments = FragmentSegments(T, S, torch.device(device), CHUNK_SIZE)
                diff = max_rel_diff(walks(x, segments), plain)
                times = ("-", "-")
                if not args.smoke:
                    f = lambda: cp_fwd_fragment_h(x["kg"], x["w"], x["u"], x["gk"], segments)  # noqa: E731
                    b = lambda: cp_bwd_fragment_dhu(x["qg"], x["kg"], x["w"], x["gk"], x["do"], x["dv"],  # noqa: E731
                                                   0.088, segments)
                    times = tuple(f"{do_bench(fn, warmup=5, rep=30) * 1e3:.1f}" for fn in (f, b))
                tile = delta_state_block_sizes(WALK_KERNELS[1], K, V)[1]  # BV as capped by the launcher
                print(f"| {HV} | {tile} | {warps} | {segments.count} | {times[0]} | {times[1]} | {diff:.1e} |",
                      flush=True)
                if not diff <= tol:
                    raise SystemExit(f"HV={HV} BV={tile} warps={warps} S={segments.count}: "
                                     f"messages differ by {diff:.1e} > {tol}")
    finally:
        for name in WALK_KERNELS:
            LAUNCH[name] = saved[name]


if __name__ == "__main__":
    main()
