"""Nsight Compute profile of one forward+backward: what bounds each kernel.

For each (op, library) it runs itself under `ncu` in a child process. The child builds
bench_ops.py's inputs (`make_op` of scripts/benchlib.py), runs the op's forward+backward
twice (compile, FLA's autotuning, warm caches) and then once between
`cudaProfilerStart`/`Stop`, so ncu (`--profile-from-start off`) sees exactly one step. Per
kernel it reads, with the clocks left alone (`--clock-control none`, as do_bench runs them):
duration, DRAM and overall memory throughput and SM throughput as % of peak (SpeedOfLight),
registers per thread, theoretical and achieved occupancy, and the two warp-stall reasons
with the most cycles per issued instruction. ncu replays each kernel once per counter pass,
so it takes a minute or two per op; the durations are those of the profiled launch.

From the repository root (scripts/tools/README.md):

    python -m scripts.tools.profile_ncu --cases kda:ours kda:fla gla:ours gla:fla --out ncu_out
    python -m scripts.tools.profile_ncu --render ncu_out/kda_ours.csv    # table of a saved report

Writes `<op>_<lib>.csv` (ncu's details page, unparsed) and `profile.md` under --out, and
prints the tables.
"""
from __future__ import annotations

import argparse
import csv
import io
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats")
# Every warp-stall reason the GPU counts, as cycles per issued instruction; a regex, so that
# no reason's name has to be known (they differ between architectures).
STALL_PREFIX, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"
STALL_METRICS = f"regex:^{STALL_PREFIX}.*{STALL_SUFFIX.replace('.', '[.]')}$"
# (column, ncu metric name) of the table; the stall columns come after.
COLUMNS = (("us", "Duration"), ("DRAM %", "DRAM Throughput"), ("memory %", "Memory Throughput"),
           ("SM %", "Compute (SM) Throughput"), ("regs", "Registers Per Thread"),
           ("occupancy % (theoretical)", "Theoretical Occupancy"), ("occupancy % (achieved)", "Achieved Occupancy"))
# The child runs as this module, from the same working directory (the repository root).
MODULE = __spec__.name if __spec__ is not None else "scripts.tools.profile_ncu"
TO_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}


def ncu_command(ncu: str, op: str, lib: str, T: int, report: Path) -> list[str]:
    sections = [arg for s in SECTIONS for arg in ("--section", s)]
    return [ncu, "--profile-from-start", "off", "--clock-control", "none", *sections, "--metrics", STALL_METRICS,
            "--csv", "--page", "details", "--log-file", str(report),
            sys.executable, "-m", MODULE, "--child", f"{op}:{lib}", "--T", str(T)]


def profiled_step(case: str, T: int) -> None:
    """The child: warm the op up, then run one forward+backward inside the profiler range."""
    import torch

    from scripts.benchlib import warm_fwd_bwd_step

    op, lib = case.split(":")
    step = warm_fwd_bwd_step(op, T, lib=lib)
    step()  # a second warm step: caches and allocator settled, as in do_bench
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def parse_details(text: str) -> list[dict]:
    """ncu's `--csv --page details` output -> one dict per profiled launch, in launch order:
    {"kernel": name, metric name: value (durations in us)}. Lines before the CSV header
    (ncu's and the program's own messages) are skipped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if '"Kernel Name"' in line and '"Metric Name"' in line), None)
    if start is None:
        raise ValueError("no ncu details table (a header with \"Kernel Name\" and \"Metric Name\") in the report")
    launches: dict[str, dict] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        if not row.get("ID") or row.get("Metric Name") is None:
            continue
        launch = launches.setdefault(row["ID"], {"kernel": row["Kernel Name"]})
        if row["Metric Name"] in launch:
            # A later section's metric of the same name is another quantity (Memory Workload
            # Analysis's "Memory Throughput" is in byte/s); the table's come first, from
            # Speed Of Light.
            continue
        value = _number(row["Metric Value"])
        if value is not None and row["Metric Name"] == "Duration":
            value *= TO_US.get(row.get("Metric Unit", "").strip(), float("nan"))
        launch[row["Metric Name"]] = value
    return list(launches.values())


def _short(name: str) -> str:
    return name.split("(")[0].split("<")[0].removeprefix("void ")[:48]


def summarise(launches: list[dict]) -> list[dict]:
    """Launches of one kernel name merged: durations summed, other metrics duration-weighted;
    longest first."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for launch in launches:
        groups[_short(launch["kernel"])].append(launch)
    rows = []
    for name, group in groups.items():
        total = sum(g.get("Duration") or 0.0 for g in group)
        row = {"kernel": name, "launches": len(group), "us": total}
        for column, metric in COLUMNS[1:]:
            pairs = [(g.get(metric), g.get("Duration") or 0.0) for g in group if g.get(metric) is not None]
            row[column] = sum(v * w for v, w in pairs) / total if pairs and total else None
        names = {m for g in group for m in g if m.startswith(STALL_PREFIX) and m.endswith(STALL_SUFFIX)}
        stalls = {m[len(STALL_PREFIX):-len(STALL_SUFFIX)]: sum((g.get(m) or 0.0) * (g.get("Duration") or 0.0)
                                                               for g in group) / total
                  for m in names} if total else {}
        row["stalls"] = sorted(((s, v) for s, v in stalls.items() if v), key=lambda sv: -sv[1])[:2]
        rows.append(row)
    return sorted(rows, key=lambda r: -r["us"])


def markdown(title: str, rows: list[dict]) -> str:
    def cell(v: float | None, fmt: str) -> str:
        return "" if v is None else format(v, fmt)

    head = ["kernel", "launches"] + [c for c, _ in COLUMNS] + ["top stalls (cycles per issue)"]
    lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        stalls = ", ".join(f"{s} {v:.1f}" for s, v in r["stalls"])
        lines.append(f"| {r['kernel']} | {r['launches']} | {cell(r['us'], '.1f')} | {cell(r['DRAM %'], '.0f')} | "
                     f"{cell(r['memory %'], '.0f')} | {cell(r['SM %'], '.0f')} | {cell(r['regs'], '.0f')} | "
                     f"{cell(r['occupancy % (theoretical)'], '.0f')} | {cell(r['occupancy % (achieved)'], '.0f')} | "
                     f"{stalls} |")
    total = sum(r["us"] for r in rows)
    lines += ["", f"Total: {total / 1e3:.3f} ms of profiled kernels.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="+", default=["kda:ours", "kda:fla", "gla:ours", "gla:fla"],
                   help="op:library pairs of benchlib.make_op (default kda and gla, ours and FLA's)")
    p.add_argument("--T", type=int, default=32768)
    p.add_argument("--out", type=Path, default=Path("ncu_out"))
    p.add_argument("--render", nargs="+", type=Path, help="only tabulate saved details CSVs")
    p.add_argument("--ncu", default="ncu", help="the Nsight Compute command (default: ncu on the PATH)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        profiled_step(args.child, args.T)
        return
    tables = []
    if args.render:
        for path in args.render:
            tables.append(markdown(path.stem, summarise(parse_details(path.read_text()))))
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        for case in args.cases:
            report = args.out / f"{case.replace(':', '_')}.csv"
            try:
                done = subprocess.run(ncu_command(args.ncu, *case.split(":"), args.T, report))
            except FileNotFoundError:
                raise SystemExit(f"no Nsight Compute at --ncu {args.ncu!r}") from None
            if done.returncode != 0:
                raise SystemExit(f"ncu failed on {case} (exit {done.returncode}); its report: {report}")
            tables.append(markdown(f"{case}, T={args.T}", summarise(parse_details(report.read_text()))))
            print(tables[-1], flush=True)
        (args.out / "profile.md").write_text("\n".join(tables))
    if args.render:
        print("\n".join(tables))


if __name__ == "__main__":
    main()
