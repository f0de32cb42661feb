"""Softmax attention under CP (K/V all-gather): per-rank time and peak memory of the layer's core.

What it measures (bf16, B=1, H query heads, Hkv key/value heads, head dim D; defaults 16 / 4 /
128), for packed batches of T = 32K, 128K, 512K and 1M tokens per CP group:

- CP=1: the whole batch on one GPU (queries and keys all T tokens).
- CP=W in {2, 4, 8}, layouts contiguous and zigzag: ONE rank's share, emulated without a
  process group. The rank's K/V rows arrive as the all-gather would deliver them (a
  `[W * rows, Hkv, 2D]` buffer, rows = the largest share); the step is what the layer runs
  after the collective: the reorder into global token order (`index_select` through
  `AttentionPlan.index`, whose backward scatters dK/dV back into the buffer that the real
  layer then reduce-scatters), and `document_causal_attention` of the rank's L = T/W queries
  against the T keys, forward and backward. The rank timed is the one with the most allowed
  (query, key) pairs, the one a step waits for; "load" is its pairs over the mean of all ranks
  (1.00 = balanced).

Documents: `single` (one document over all T tokens: full causal attention, the worst case)
and `varlen` (lengths log-uniform in 64..8192, packed to T: mostly block-diagonal work).

Kernels: `flex` (torch.compile'd flex_attention with the block-sparse mask computed from the
per-query bounds, `cp_linattn.cp.attention.document_block_mask`; its build time is the
"mask ms" column: once per batch, shared by every attention layer) and `sdpa`
(scaled_dot_product_attention with an explicit `[L, T']` boolean mask: it OOMs once the mask
no longer fits; "OOM" rows say so). torch's ring attention (torch.distributed.tensor's
context_parallel) needs a real process group per CP degree, so it is not emulated here.

Not timed: the collectives themselves (one GPU has none). The volume each rank receives per
attention layer is in the "all-gather MiB" column (the backward reduce-scatter moves the same).
Time is the median of CUDA-event timings after one warm-up call (torch.compile's); peak
memory is torch.cuda.max_memory_allocated over one fwd+bwd, inputs and the gathered buffer
included. "TFLOP/s" counts 7 matmuls (2 forward, 5 backward) per allowed pair:
14 * pairs * H * D FLOPs.

    python scripts/bench_attention.py --out bench_out/attention            # the full sweep
    python scripts/bench_attention.py --out bench_out/attention --sizes 1M --docs single
    python scripts/bench_attention.py --out bench_out/attention --quick    # 32K and 128K only

The full sweep runs the single-document 1M cases in tens of seconds per call; split it with
--sizes / --docs when a command has a time limit. The JSON (DIR/bench_attention.json) is
rewritten after every row, so an interrupted sweep keeps what it measured. Without CUDA,
--quick runs tiny sizes with the sdpa kernel in fp32 on the CPU (a check of the script; flex
needs CUDA here).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from cp_linattn.cp.attention import document_causal_attention, plan_from_ranges
from cp_linattn.cp.context import layout_ranges

SIZES = {"32K": 32 * 1024, "128K": 128 * 1024, "512K": 512 * 1024, "1M": 1024 * 1024}


def parse_size(text: str) -> int:
    """'32K', '1M' or a plain token count."""
    text = text.upper()
    if text in SIZES:
        return SIZES[text]
    scale = {"K": 1024, "M": 1024 * 1024}.get(text[-1:], 1)
    return int(text[:-1] if scale > 1 else text) * scale


def size_label(T: int) -> str:
    for label, n in SIZES.items():
        if n == T:
            return label
    return str(T)


def documents(T: int, kind: str, seed: int = 0) -> torch.Tensor:
    """Global offsets int64 `[N + 1]` (CPU): one document (`single`) or lengths log-uniform in
    64..8192 packed to exactly T (`varlen`)."""
    if kind == "single":
        return torch.tensor([0, T])
    gen = torch.Generator().manual_seed(seed)
    lens, left = [], T
    while left > 0:
        n = min(left, int(math.exp(torch.empty(1).uniform_(math.log(64), math.log(8192), generator=gen).item())))
        lens.append(n)
        left -= n
    return torch.tensor([0] + lens).cumsum(0)


def rank_loads(cu: torch.Tensor, all_ranges) -> list[int]:
    """Allowed (query, key) pairs of every rank: its causal work."""
    return [plan_from_ranges(cu, all_ranges, r).pairs for r in range(len(all_ranges))]


class Timer:
    """Median wall time of a callable: CUDA events on the GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device, min_time: float, max_reps: int) -> None:
        self.cuda = device.type == "cuda"
        self.min_time, self.max_reps = min_time, max_reps

    def once(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def median(self, fn) -> float:
        times = []
        while not times or (sum(times) < self.min_time * 1e3 and len(times) < self.max_reps):
            times.append(self.once(fn))
        return statistics.median(times)


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def bench_case(cu: torch.Tensor, all_ranges, rank: int, kernel: str, H: int, Hkv: int, D: int,
               dtype: torch.dtype, device: torch.device, timer: Timer) -> dict:
    """One rank's reorder + attention forward and backward: {ms, mask_ms, peak_gib, status}."""
    plan = plan_from_ranges(cu, all_ranges, rank, device)
    L, W = plan.q_pos.numel(), len(all_ranges)
    out = dict(status="ok", ms=None, mask_ms=None, peak_gib=None)
    gen = torch.Generator(device=device).manual_seed(0)
    try:
        q = torch.randn(1, L, H, D, device=device, dtype=dtype, generator=gen).requires_grad_()
        buffer = torch.randn(W * plan.rows, Hkv, 2 * D, device=device, dtype=dtype, generator=gen).requires_grad_()
        do = torch.randn(1, L, H, D, device=device, dtype=dtype, generator=gen)
        block_mask = None
        if kernel == "flex":
            out["mask_ms"] = timer.once(lambda: plan.block_mask())  # built once here, then reused
            block_mask = plan.block_mask()

        def step():
            q.grad = buffer.grad = None
            kv = buffer.index_select(0, plan.index)[None]  # [1, T, Hkv, 2D]
            k, v = kv.split([D, D], dim=-1)
            o = document_causal_attention(q, k, v, plan.q_pos, plan.q_lo, kernel=kernel, block_mask=block_mask)
            o.backward(do)

        step()  # warm-up (compiles flex)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        first = timer.once(step)
        if device.type == "cuda":
            out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["ms"] = statistics.median([first, timer.median(step)]) if first < timer.min_time * 1e3 else first
    except torch.OutOfMemoryError as e:
        out["status"] = "OOM"
        out["error"] = str(e).split("\n")[0][:200]
    finally:
        q = buffer = do = block_mask = None
        _free()
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["| docs | T | CP | layout | rank | kernel | fwd+bwd ms | TFLOP/s | peak GiB | mask ms | load | "
             "all-gather MiB/rank | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    for r in rows:
        lines.append(f"| {r['docs']} | {r['T_label']} | {r['cp']} | {r['layout']} | {r['rank']} | {r['kernel']} | "
                     f"{fmt(r['ms'], '.2f')} | {fmt(r['tflops'], '.0f')} | {fmt(r['peak_gib'], '.2f')} | "
                     f"{fmt(r['mask_ms'], '.2f')} | {r['load']:.2f} | {r['gather_mib']:.0f} | {r['status']} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench_out/attention"), help="folder for bench_attention.json")
    p.add_argument("--quick", action="store_true", help="32K and 128K, CP 1 and 4 (CPU: tiny sizes, sdpa, fp32)")
    p.add_argument("--sizes", nargs="+", help="tokens per CP group: 32K 128K 512K 1M (default) or counts")
    p.add_argument("--degrees", type=int, nargs="+", help="CP degrees (default 1 2 4 8)")
    p.add_argument("--layouts", nargs="+", choices=["contiguous", "zigzag"], default=["contiguous", "zigzag"])
    p.add_argument("--kernels", nargs="+", choices=["flex", "sdpa"], help="default flex sdpa (CPU: sdpa)")
    p.add_argument("--docs", nargs="+", choices=["single", "varlen"], help="default single varlen")
    p.add_argument("--heads", type=int, default=16, help="query heads H")
    p.add_argument("--kv-heads", type=int, default=4, help="key/value heads Hkv (GQA)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--min-time", type=float, default=1.0, help="seconds of timed calls per case (at least one)")
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:
        sizes = args.sizes or (["32K", "128K"] if args.quick else list(SIZES))
        degrees = args.degrees or ([1, 4] if args.quick else [1, 2, 4, 8])
        kernels = args.kernels or ["flex", "sdpa"]
        docs = args.docs or (["single"] if args.quick else ["single", "varlen"])
        H, Hkv, D = args.heads, args.kv_heads, args.head_dim
    else:
        if not args.quick:
            sys.exit("no CUDA device: only --quick runs here (tiny sizes, sdpa, fp32)")
        sizes, degrees, docs = args.sizes or ["1000"], args.degrees or [1, 3], args.docs or ["single", "varlen"]
        kernels = ["sdpa"]
        H, Hkv, D = 4, 2, 16
    if "flex" in (args.kernels or []) and not cuda:
        sys.exit("--kernels flex needs CUDA here")
    if H % Hkv:
        p.error(f"--heads {H} must be a multiple of --kv-heads {Hkv}")
    timer = Timer(device, args.min_time if cuda else 0.0, 20)
    meta = dict(device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                date=time.strftime("%Y-%m-%d %H:%M"), command="python " + shlex.join(sys.argv),
                dtype=str(dtype).replace("torch.", ""), H=H, Hkv=Hkv, D=D,
                timer="CUDA events, median after one warm-up" if cuda else "wall clock (CPU: a check of the script)",
                note="one rank emulated, collectives not timed; the rank with the most allowed pairs")
    print(f"{meta['device']}, torch {meta['torch']}, {meta['date']}; {meta['dtype']}, H={H}, Hkv={Hkv}, D={D}")
    print(f"command: {meta['command']}", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_attention.json"
    rows: list[dict] = []
    elem = torch.tensor([], dtype=dtype).element_size()
    for doc_kind in docs:
        for size in sizes:
            T = parse_size(size)
            cu = documents(T, doc_kind)
            for W in degrees:
                for layout in (["contiguous"] if W == 1 else args.layouts):
                    all_ranges = layout_ranges(T, W, layout)
                    loads = rank_loads(cu, all_ranges)
                    rank = max(range(W), key=loads.__getitem__)
                    rows_per_rank = max(sum(e - s for s, e in rs) for rs in all_ranges)
                    for kernel in kernels:
                        res = bench_case(cu, all_ranges, rank, kernel, H, Hkv, D, dtype, device, timer)
                        row = dict(docs=doc_kind, T=T, T_label=size_label(T), cp=W, layout=layout if W > 1 else "-",
                                   rank=rank, kernel=kernel, pairs=loads[rank],
                                   load=loads[rank] / statistics.mean(loads),
                                   gather_mib=(W - 1) * rows_per_rank * Hkv * 2 * D * elem / 2**20, **res)
                        row["tflops"] = 14 * row["pairs"] * H * D / row["ms"] / 1e9 if row["ms"] else None
                        rows.append(row)
                        print(markdown([row]).splitlines()[-1], flush=True)
                        path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print()
    print(markdown(rows))
    print(f"\nrows written to {path}")


if __name__ == "__main__":
    main()
