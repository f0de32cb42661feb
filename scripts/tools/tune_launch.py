"""Sweep the launch settings of ops/launch.py on a GPU and print a per-kernel profile.

For each kernel of an op, one setting at a time (coordinate descent: warps, stages, tile
caps), the op's forward+backward is timed with `triton.testing.do_bench` (median, after a
compile-and-warm-up call) and the best value is kept before the next setting. The result is
printed as the `LAUNCH` entries to paste into cp_linattn/ops/launch.py, with a
torch.profiler breakdown (CUDA time per kernel) before and after.

From the repository root (scripts/tools/README.md):

    python -m scripts.tools.tune_launch --ops gla kda --T 32768 --json tune.json
    python -m scripts.tools.tune_launch --ops kda --T 32768 --varlen --no-sweep   # profile of the varlen batch
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import triton
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from triton.runtime.errors import OutOfResources

from cp_linattn.ops.launch import LAUNCH
from scripts.benchlib import profile_kernels, warm_fwd_bwd_step

# The kernels each op launches in forward+backward, and the values tried for each setting.
# The launches of the exact diagonal path (`*_exact`) only do work under strong decays: the
# in-kernel gate with N(0, 1) parameters (kda_gate) has them.
OP_KERNELS = {
    "gla": ["chunk_fwd_h", "chunk_bwd_dh", "chunk_gla_fwd_o", "chunk_gla_bwd_dv", "chunk_gla_bwd_dqkg"],
    "kda": ["chunk_delta_rule_fwd_h", "chunk_delta_rule_bwd_dhu", "chunk_kda_fwd_intra", "chunk_kda_fwd_o", "chunk_kda_bwd_dAv",
            "chunk_kda_bwd_wy_dqkg", "chunk_kda_bwd_intra"],
    "kda_gate": ["chunk_kda_fwd_intra_exact", "chunk_kda_bwd_intra_exact"],
}
CHOICES = {"num_warps": (2, 4, 8), "num_stages": (1, 2, 3), "BK": (16, 32, 64), "BV": (16, 32, 64, 128)}


def time_fwd_bwd(op: str, T: int) -> float:
    return triton.testing.do_bench(warm_fwd_bwd_step(op, T), warmup=5, rep=40, return_mode="median")


def launch_sequence(step: Callable[[], object]) -> list[tuple[str, float]]:
    """(kernel, CUDA ms) of every launch of one warm call, in launch order: the two launches of
    a split kernel show up one after the other: `<kernel>`, then `<kernel>_exact`."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return [(e.name, e.device_time_total / 1e3) for e in sorted(prof.events(), key=lambda e: e.time_range.start)
            if e.device_type == DeviceType.CUDA]


def kernel_profile(op: str, T: int, varlen: bool = False) -> list[tuple[str, float, int]]:
    """(kernel, CUDA ms per fwd+bwd, calls per fwd+bwd) sorted by time."""
    return profile_kernels(warm_fwd_bwd_step(op, T, varlen))


def print_profile(title: str, rows: list[tuple[str, float, int]]) -> None:
    total = sum(r[1] for r in rows)
    print(f"\n{title}: {total:.2f} ms of kernels per fwd+bwd")
    for name, ms, calls in rows[:14]:
        print(f"  {ms:8.3f} ms {100 * ms / total:5.1f}%  x{calls:<3d} {name[:90]}")


def tune(op: str, T: int, kernels: list[str], log: list) -> None:
    best = time_fwd_bwd(op, T)
    print(f"\n{op} T={T}: start {best:.3f} ms", flush=True)
    for kernel in kernels:
        for key in [k for k in CHOICES if k in LAUNCH[kernel]]:
            start = LAUNCH[kernel][key]
            for value in CHOICES[key]:
                if value == LAUNCH[kernel][key]:
                    continue
                keep = LAUNCH[kernel][key]
                LAUNCH[kernel][key] = value
                t0 = time.perf_counter()
                try:
                    ms = time_fwd_bwd(op, T)
                except OutOfResources as e:  # the value is simply not usable
                    ms = float("inf")
                    print(f"  {kernel}.{key}={value}: {str(e)[:120]}")
                log.append(dict(op=op, kernel=kernel, key=key, value=value, ms=ms))
                print(f"  {kernel}.{key}={value}: {ms:.3f} ms (best {best:.3f}, {time.perf_counter() - t0:.0f} s)",
                      flush=True)
                if ms < best * 0.99:
                    best = ms
                else:
                    LAUNCH[kernel][key] = keep
            if LAUNCH[kernel][key] != start:
                print(f"  -> {kernel}.{key}: {start} -> {LAUNCH[kernel][key]}")
    print(f"{op} T={T}: tuned {best:.3f} ms")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ops", nargs="+", default=list(OP_KERNELS), choices=list(OP_KERNELS))
    p.add_argument("--T", type=int, default=32768)
    p.add_argument("--kernels", nargs="+", default=None, help="sweep only these (default: all of the op)")
    p.add_argument("--no-sweep", action="store_true", help="only print the profile")
    p.add_argument("--varlen", action="store_true",
                   help="profile the packed varlen batch (benchlib.varlen_cu_seqlens) of T tokens (with --no-sweep)")
    p.add_argument("--sequence", action="store_true", help="also list every launch of one call in order")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    print(torch.cuda.get_device_name(), time.strftime("%Y-%m-%d"), "triton", triton.__version__)
    log: list = []
    if args.varlen and not args.no_sweep:
        p.error("--varlen profiles only: add --no-sweep")
    for op in args.ops:
        title = f"{op} T={args.T}{' varlen' if args.varlen else ''} (current settings)"
        print_profile(title, kernel_profile(op, args.T, args.varlen))
        if args.sequence:
            for name, ms in launch_sequence(warm_fwd_bwd_step(op, args.T, args.varlen)):
                print(f"    {ms:8.3f} ms  {name[:90]}")
        if args.no_sweep:
            continue
        tune(op, args.T, [k for k in OP_KERNELS[op] if args.kernels is None or k in args.kernels], log)
        print_profile(f"{op} T={args.T} (tuned)", kernel_profile(op, args.T))
        for kernel in OP_KERNELS[op]:
            print(f'    "{kernel}": dict({", ".join(f"{k}={v}" for k, v in LAUNCH[kernel].items())}),')
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(launch=LAUNCH, log=log), f, indent=1)


if __name__ == "__main__":
    main()
