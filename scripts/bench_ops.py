"""Benchmark our chunk_gla / fused_chunk_gla / chunk_kda against FLA 0.6.0 and torch SDPA:
speed, and accuracy against the fp32 reference.

Same process, same inputs: bf16, B=1, H=16, K=V=128. Every op is called forward+backward
once before timing so Triton compilation and FLA's autotuning stay out of the figures
(the compile time of that first call is reported separately). Timings are medians of
`triton.testing.do_bench` (CUDA events, L2 flushed between runs).

After all timings, the accuracy pass runs every benchmarked op of ours and FLA's (FLA's
chunk_gla for fused_gla) forward+backward on the same bf16 inputs of `--accuracy-T` tokens (and,
unless `--varlen-total 0`, a packed batch of that many tokens in documents of odd lengths) with
the same cotangent, and the fp32 token-by-token reference (ops/*/naive.py) on those inputs upcast
to fp32: the RMS error of the output and of every gradient relative to the reference's RMS, ours,
FLA's and ours/FLA (at most 1: ours at least as accurate).

    python scripts/bench_ops.py --out bench_out        # writes results.json, results.md, throughput.png
    python scripts/bench_ops.py --render a/results.json b.log --out merged   # tables of several runs
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import triton

from benchlib import (H, K, V, accuracy_doc_lengths, make_op, op_call, op_inputs,  # scripts/benchlib.py
                      outputs_and_grads, reference_call, rms_rel_err, varlen_cu_seqlens)


def _measure_copy_bandwidth() -> float:
    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), return_mode="median")
    return 2 * x.numel() * x.element_size() / (ms * 1e-3)


def _bytes_moved(name: str, T: int, fwd_only: bool) -> int:
    """Lower bound of HBM traffic: inputs, outputs and gradients once each, plus the fp32
    per-chunk states written once in the forward and read once in the backward."""
    HV = 2 * H if "gva" in name else H
    bf = 2
    inputs = T * (2 * H * K + HV * V + HV * K + (HV if name.startswith("kda") else 0)) * bf
    out = T * HV * V * bf
    states = math.ceil(T / 64) * HV * K * V * 4
    if fwd_only:
        return inputs + out + states
    return 2 * inputs + 2 * out + 2 * states  # backward re-reads inputs + do, writes grads


def _flops(name: str, T: int, fwd_only: bool) -> float:
    """FLOPs of the chunked algorithm (C = 64): intra-chunk C x C products, state update and
    state read-out; the delta rule adds the WY products (Akk, w, u and v_new = u - w h)."""
    C, HV = 64, (2 * H if "gva" in name else H)
    if name == "sdpa":
        fwd = 2 * 2 * T * T * K * H / 2
        return fwd if fwd_only else 3.5 * fwd
    per_token = 2 * C * K + 2 * C * V + 4 * K * V
    if name.startswith("kda"):
        per_token += 2 * C * K + 2 * C * K + 2 * C * V + 2 * K * V
    fwd = per_token * T * HV
    return fwd if fwd_only else 3 * fwd


def bench_one(name: str, lib: str, T: int, cu_seqlens) -> dict:
    fn, leaves = make_op(name, lib, T, cu_seqlens)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    do = torch.randn_like(out)
    out.backward(do)
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0

    def fwd():
        with torch.no_grad():
            fn()

    def fwd_bwd():
        for x in leaves:
            x.grad = None
        fn().backward(do)

    fwd_ms = triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median")
    fb_ms = triton.testing.do_bench(fwd_bwd, warmup=25, rep=100, return_mode="median")
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    row = dict(op=name, lib=lib, T=T, varlen=cu_seqlens is not None, fwd_ms=fwd_ms, fwd_bwd_ms=fb_ms,
               peak_mib=peak, compile_s=compile_s)
    if name != "sdpa":
        row["fwd_bwd_GBps"] = _bytes_moved(name, T, False) / (fb_ms * 1e-3) / 1e9
    row["fwd_bwd_TFLOPs"] = _flops(name, T, False) / (fb_ms * 1e-3) / 1e12
    row["tokens_per_s"] = T / (fb_ms * 1e-3)
    return row


def accuracy_rows(name: str, T: int, cu_seqlens) -> list[dict]:
    """RMS errors relative to the fp32 reference of our op `name` and of FLA's (its chunk_gla for
    fused_gla), output and every gradient, on the same bf16 inputs and cotangent (seed 11)."""
    x = op_inputs(name, T)
    names = ["q", "k", "v", "g"] + (["beta"] if name.startswith("kda") else [])
    x = {n: x[n] for n in names + (["A_log", "dt_bias"] if "A_log" in x else [])}
    # rounded to bf16, so the reference sees the cotangent ours and FLA's see
    do = torch.randn(x["v"].shape, generator=torch.Generator().manual_seed(11)).bfloat16().float().to(x["v"].device)
    want = outputs_and_grads(reference_call(name, cu_seqlens), {n: t.float() for n, t in x.items()}, do)
    got = outputs_and_grads(op_call(name, "ours", cu_seqlens), x, do)
    theirs = outputs_and_grads(op_call(name.replace("fused_", ""), "fla", cu_seqlens), x, do)
    case = dict(op=name, T=T, varlen=cu_seqlens is not None)
    if cu_seqlens is not None:
        case["doc_lengths"] = cu_seqlens.diff().tolist()
    rows = []
    for tensor, ref in want.items():
        ours_err, fla_err = rms_rel_err(got[tensor], ref), rms_rel_err(theirs[tensor], ref)
        rows.append(dict(case, tensor=tensor, ours_err=ours_err, fla_err=fla_err,
                         ratio=ours_err / fla_err if fla_err > 0 else None))
    return rows


CASES = {
    "gla": [("gla", "ours"), ("fused_gla", "ours"), ("gla", "fla")],
    "kda": [("kda", "ours"), ("kda", "fla")],
    "kda_gva": [("kda_gva", "ours"), ("kda_gva", "fla")],
    "kda_gate": [("kda_gate", "ours"), ("kda_gate", "fla")],
    "kda_gate_init": [("kda_gate_init", "ours"), ("kda_gate_init", "fla")],
    "sdpa": [("sdpa", "torch")],
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    p.add_argument("--groups", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--varlen-total", type=int, default=32768, help="tokens of the varlen case; 0 skips it")
    p.add_argument("--accuracy-T", type=int, default=1000,
                   help="tokens of the accuracy pass (dense, and packed in documents unless --varlen-total 0); "
                        "0 skips it")
    p.add_argument("--out", default="bench_out")
    p.add_argument("--render", nargs="+", metavar="FILE", default=None,
                   help="measure nothing: merge the rows of earlier runs (results.json, or the JSON lines "
                        "they print) and write results.md and throughput.png")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.render:
        rows, accuracy, meta = _load_rows(args.render)
        (out / "results.md").write_text(_markdown(rows, meta, accuracy))
        _plot(rows, out / "throughput.png")
        print((out / "results.md").read_text())
        return
    bw = _measure_copy_bandwidth()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                copy_bandwidth_GBps=bw / 1e9, date=time.strftime("%Y-%m-%d"))
    rows, accuracy = [], []
    for group in args.groups:
        for T in args.T + ([None] if group != "sdpa" and args.varlen_total > 0 else []):
            cu = None
            if T is None:
                T, cu = args.varlen_total, varlen_cu_seqlens(args.varlen_total)
            for name, lib in CASES[group]:
                if name == "fused_gla" and cu is not None:
                    continue
                try:
                    row = bench_one(name, lib, T, cu)
                except Exception as e:  # report and go on: one failing config must not hide the rest
                    row = dict(op=name, lib=lib, T=T, varlen=cu is not None, error=f"{type(e).__name__}: {e}"[:300])
                rows.append(row)
                print(json.dumps(row), flush=True)
                # rewritten after every row: a run stopped by a time limit keeps what it measured
                _save(out, meta, rows, accuracy)
                torch.cuda.empty_cache()
    _plot(rows, out / "throughput.png")
    # after every timing, so that no kernel is first compiled or autotuned at the accuracy pass's shapes
    if args.accuracy_T > 0:
        for new in accuracy_pass(args.groups, args.accuracy_T, args.varlen_total > 0):
            for row in new:
                print(json.dumps(row), flush=True)
            accuracy += new
            _save(out, meta, rows, accuracy)
    print((out / "results.md").read_text())


def accuracy_pass(groups: list[str], T: int, varlen: bool, device: str = "cuda"):
    """The `accuracy_rows` of each of our ops in `groups` (fused_gla dense only), on T tokens
    dense and, with `varlen`, packed in `accuracy_doc_lengths(T)`: one list per op and case, an
    op that fails giving an error row."""
    packed = torch.tensor([0] + accuracy_doc_lengths(T)).cumsum(0).to(device)
    for group in groups:
        for cu in [None] + ([packed] if varlen else []):
            for name, lib in CASES[group]:
                if lib != "ours" or (name == "fused_gla" and cu is not None):
                    continue
                try:
                    new = accuracy_rows(name, T, cu)
                    torch.cuda.empty_cache()
                except Exception as e:  # reported, and the pass goes on
                    new = [dict(op=name, T=T, varlen=cu is not None, tensor=None, error=f"{type(e).__name__}: {e}"[:300])]
                yield new


def _save(out: Path, meta: dict, rows: list[dict], accuracy: list[dict]) -> None:
    (out / "results.json").write_text(json.dumps(dict(meta=meta, rows=rows, accuracy=accuracy), indent=1))
    (out / "results.md").write_text(_markdown(rows, meta, accuracy))


def _load_rows(paths: list[str]) -> tuple[list[dict], list[dict], dict]:
    """Speed rows and accuracy rows of several runs (a results.json, or a log of the JSON lines a
    run prints, e.g. one cut short by a time limit), in order, and the meta of the first
    results.json."""
    rows, accuracy, meta = [], [], None
    for path in paths:
        text = Path(path).read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None
        if isinstance(data, dict) and "rows" in data:
            rows += data["rows"]
            accuracy += data.get("accuracy", [])
            meta = meta or data["meta"]
            continue
        for line in text.splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                if "lib" in row:
                    rows.append(row)
                elif "tensor" in row:
                    accuracy.append(row)
    if meta is None:
        raise ValueError(f"--render needs at least one results.json (for the machine and bandwidth): {paths}")
    return rows, accuracy, meta


def _markdown(rows, meta, accuracy=()) -> str:
    lines = [f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}; "
             f"measured copy bandwidth {meta['copy_bandwidth_GBps']:.0f} GB/s", ""]
    ref = {(r["op"].replace("fused_", ""), r["T"], r["varlen"]): r for r in rows if r["lib"] == "fla" and "error" not in r}
    lines.append("| op | lib | T | fwd ms | fwd+bwd ms | FLA/ours f+b | peak MiB | GB/s f+b | % of copy bw | TFLOP/s |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        T = f"{r['T']}{' varlen' if r['varlen'] else ''}"
        if "error" in r:
            lines.append(f"| {r['op']} | {r['lib']} | {T} | error: {r['error']} | | | | | | |")
            continue
        f = ref.get((r["op"].replace("fused_", ""), r["T"], r["varlen"]))
        ratio = f"{f['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x" if f and r["lib"] != "fla" else ""
        gbps = r.get("fwd_bwd_GBps")
        bw = f"{gbps:.0f} | {100 * gbps / meta['copy_bandwidth_GBps']:.0f}%" if gbps else " | "
        lines.append(f"| {r['op']} | {r['lib']} | {T} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | {ratio} | "
                     f"{r['peak_mib']:.0f} | {bw} | {r['fwd_bwd_TFLOPs']:.1f} |")
    if accuracy:
        lines += ["", "Accuracy against the fp32 reference, same bf16 inputs: RMS relative error, ours/FLA "
                  "(fused_gla against FLA's chunk_gla; at most 1.00: ours at least as accurate)."]
        for T, lengths in dict.fromkeys((r["T"], tuple(r["doc_lengths"])) for r in accuracy if "doc_lengths" in r):
            lines.append(f"{T} varlen: documents of {', '.join(map(str, lengths))} tokens.")
        lines += ["", "| op | T | tensor | ours | FLA | ours/FLA |", "|---|---|---|---|---|---|"]
        for r in accuracy:
            T = f"{r['T']}{' varlen' if r['varlen'] else ''}"
            if "error" in r:
                lines.append(f"| {r['op']} | {T} | error: {r['error']} | | | |")
                continue
            ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
            lines.append(f"| {r['op']} | {T} | {r['tensor']} | {r['ours_err']:.2e} | {r['fla_err']:.2e} | {ratio} |")
    return "\n".join(lines) + "\n"


def _plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, family in zip(axes, ("gla", "kda")):
        for r_op, r_lib in {(r["op"], r["lib"]) for r in rows if r["op"] in (family, f"fused_{family}", "sdpa")}:
            pts = sorted((r["T"], r["tokens_per_s"]) for r in rows
                         if r["op"] == r_op and r["lib"] == r_lib and not r["varlen"] and "error" not in r)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{r_op} ({r_lib})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T (tokens)")
        ax.set_ylabel("fwd+bwd tokens/s (B=1, H=16, K=V=128, bf16)")
        ax.set_title(family.upper())
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
