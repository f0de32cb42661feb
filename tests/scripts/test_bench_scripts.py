"""The scripts' host sides and smoke modes: the user benchmarks (scripts/bench_ops.py: tables
and plot from stored rows, the byte/FLOP counts of every benchmarked op, the accuracy pass's
rows on CPU stand-ins; scripts/bench_cp.py) and the maintainer tools (scripts/tools/).

Each is imported as its documented command runs it: a user benchmark as the file
`python scripts/<name>.py` runs, with scripts/ on the path (it imports scripts/benchlib.py as
`benchlib`); a tool as the module `scripts.tools.<name>` (`python -m` from the repository root,
which pytest's `pythonpath = ["."]` puts on the path)."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]


def load_benchmark(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """scripts/<name>.py as `python scripts/<name>.py` loads it: scripts/ first on the path."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # bench_cp's dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def load_tool(name: str) -> ModuleType:
    """scripts/tools/<name>.py as `python -m scripts.tools.<name>` loads it."""
    module = importlib.import_module(f"scripts.tools.{name}")
    assert Path(module.__file__) == ROOT / "scripts" / "tools" / f"{name}.py"
    return module


# Each script as its documented command runs it (README.md, scripts/tools/README.md).
COMMANDS = {"bench_ops": ["scripts/bench_ops.py"], "bench_cp": ["scripts/bench_cp.py"],
            **{tool: ["-m", f"scripts.tools.{tool}"] for tool in ("tune_launch", "profile_ncu", "bench_walks",
                                                                  "kernel_regs")}}


@pytest.mark.parametrize("name", COMMANDS)
def test_documented_command_starts(name):
    """Every script starts (its imports resolve, --help answers) as documented, from the
    repository root with only the package on the path: no sys.path edit needed."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # the package, as `pip install -e .` makes it importable
    done = subprocess.run([sys.executable, *COMMANDS[name], "--help"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-2000:]


def test_scripts_share_code_only_through_benchlib():
    """No script edits sys.path or imports another script (what they share is in
    scripts/benchlib.py), and none names a path of a particular machine."""
    files = sorted((ROOT / "scripts").rglob("*.py"))
    scripts = {path.stem for path in files} - {"benchlib", "__init__"}
    assert {"bench_ops", "bench_cp", "tune_launch", "profile_ncu", "bench_walks", "kernel_regs"} <= scripts
    for path in files:
        text = path.read_text()
        assert not re.search(r"(?<![\w.~])/(tmp|root|home|work|scratch)/", text), path
        for node in ast.walk(ast.parse(text)):
            assert not (isinstance(node, ast.Attribute) and node.attr == "path"
                        and isinstance(node.value, ast.Name) and node.value.id == "sys"), (path, node.lineno)
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for module in modules:
                assert module.split(".")[-1] not in scripts, (path, module)


@pytest.fixture(scope="module")
def bench_ops():
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield load_benchmark("bench_ops", monkeypatch)


def test_render_stored_rows(bench_ops, tmp_path, monkeypatch):
    """--render rebuilds the tables (speed ratios against FLA of the same shape; the accuracy
    table, its error rows and the varlen case's documents) and the plot from a results.json and
    from the JSON lines of a run cut short."""
    stored = json.loads((ROOT / "benchmarks" / "h100_0a8286b" / "bench_ops_0a8286b.json").read_text())
    row = dict(op="kda_gate_init", lib="ours", T=32768, varlen=False, fwd_ms=3.0, fwd_bwd_ms=8.0, peak_mib=1.0,
               tokens_per_s=4e6, fwd_bwd_TFLOPs=30.0, fwd_bwd_GBps=300.0)
    fla = dict(row, lib="fla", fwd_bwd_ms=12.0)
    stored["accuracy"] = [
        dict(op="gla", T=1000, varlen=False, tensor="o", ours_err=2e-3, fla_err=4e-3, ratio=0.5),
        dict(op="kda_gate", T=1000, varlen=True, doc_lengths=[301, 21, 251, 427], tensor="dA_log", ours_err=1e-3,
             fla_err=0.0, ratio=None),
        dict(op="kda_gva", T=1000, varlen=False, tensor=None, error="RuntimeError: out of memory"),
    ]
    cut = dict(op="kda", T=1000, varlen=False, tensor="dbeta", ours_err=3e-3, fla_err=2e-3, ratio=1.5)
    (tmp_path / "cut.log").write_text("starting\n" + "\n".join(json.dumps(r) for r in (row, fla, cut)) + "\n")
    (tmp_path / "results.json").write_text(json.dumps(stored))
    monkeypatch.setattr(sys, "argv", ["bench_ops.py", "--render", str(tmp_path / "results.json"),
                                      str(tmp_path / "cut.log"), "--out", str(tmp_path / "out")])
    bench_ops.main()
    table = (tmp_path / "out" / "results.md").read_text()
    speed, accuracy = table.split("Accuracy against the fp32 reference, same bf16 inputs: RMS relative error, ours/FLA")
    assert "| kda_gate_init | ours | 32768 | 3.000 | 8.000 | 1.50x |" in speed
    assert speed.count("\n| ") == len(stored["rows"]) + 3  # header, rule, stored rows, two new rows
    assert "1000 varlen: documents of 301, 21, 251, 427 tokens." in accuracy
    assert accuracy.count("\n| ") == 1 + 4  # header, three stored rows, one from the log
    for line in ("| gla | 1000 | o | 2.00e-03 | 4.00e-03 | 0.50 |",
                 "| kda_gate | 1000 varlen | dA_log | 1.00e-03 | 0.00e+00 |  |",  # no ratio where FLA's error is 0
                 "| kda_gva | 1000 | error: RuntimeError: out of memory | | | |",
                 "| kda | 1000 | dbeta | 3.00e-03 | 2.00e-03 | 1.50 |"):
        assert line in accuracy, accuracy
    assert (tmp_path / "out" / "throughput.png").stat().st_size > 0


def _small_inputs(name: str, T: int) -> dict:
    """`op_inputs` of op `name` at H = 2, K = V = 8 on the CPU."""
    gen = torch.Generator().manual_seed(0)
    x = dict(q=torch.randn(1, T, 2, 8, generator=gen), k=F.normalize(torch.randn(1, T, 2, 8, generator=gen), dim=-1),
             v=torch.randn(1, T, 2, 8, generator=gen), g=F.logsigmoid(torch.randn(1, T, 2, 8, generator=gen)),
             beta=torch.rand(1, T, 2, generator=gen))
    x = {n: t.bfloat16() for n, t in x.items()}
    if name.startswith("kda_gate"):
        x.update(A_log=torch.randn(2, generator=gen), dt_bias=torch.randn(16, generator=gen))
    return x


@pytest.mark.parametrize("name, varlen", [("gla", False), ("fused_gla", False), ("kda", True), ("kda_gate", True)])
def test_accuracy_rows_compare_ours_and_fla_with_the_reference(bench_ops, monkeypatch, name, varlen):
    """accuracy_rows gives, for the output and every gradient of the op, ours' and FLA's RMS error
    against the fp32 reference and their ratio (here ours is the reference run on the bf16 inputs,
    FLA's that output 5% too large; fused_gla is compared with FLA's chunk_gla)."""
    calls = []

    def op_call(op, lib, cu_seqlens):
        calls.append((op, lib))
        reference = bench_ops.reference_call(op, cu_seqlens)
        return reference if lib == "ours" else (lambda **x: 1.05 * reference(**x))

    monkeypatch.setattr(bench_ops, "op_inputs", _small_inputs)
    monkeypatch.setattr(bench_ops, "op_call", op_call)
    lengths = bench_ops.accuracy_doc_lengths(40)
    cu = torch.tensor([0] + lengths).cumsum(0) if varlen else None
    rows = bench_ops.accuracy_rows(name, 40, cu)
    assert calls == [(name, "ours"), (name.replace("fused_", ""), "fla")]
    tensors = ["o", "dq", "dk", "dv", "dg"] + (["dbeta"] if name.startswith("kda") else []) + (
        ["dA_log", "ddt_bias"] if name == "kda_gate" else [])
    assert [r["tensor"] for r in rows] == tensors
    for r in rows:
        assert (r["op"], r["T"], r["varlen"], r.get("doc_lengths")) == (name, 40, varlen, lengths if varlen else None)
        assert r["ours_err"] < 5e-3 and 0.02 < r["fla_err"] < 0.1, r
        assert r["ratio"] == pytest.approx(r["ours_err"] / r["fla_err"]) and r["ratio"] < 0.2


def test_accuracy_pass_covers_every_benchmarked_op_and_reports_failures(bench_ops, monkeypatch):
    """The accuracy pass takes each of our ops of the groups, dense and packed (fused_gla dense
    only; sdpa has none), and an op that fails gives an error row and the pass goes on."""
    def accuracy_rows(name, T, cu_seqlens):
        if name == "kda" and cu_seqlens is not None:
            raise RuntimeError("boom")
        return [dict(op=name, T=T, varlen=cu_seqlens is not None, tensor="o")]

    monkeypatch.setattr(bench_ops, "accuracy_rows", accuracy_rows)
    lists = list(bench_ops.accuracy_pass(list(bench_ops.CASES), 1000, True, device="cpu"))
    assert [(r["op"], r["varlen"]) for new in lists for r in new] == [
        ("gla", False), ("fused_gla", False), ("gla", True), ("kda", False), ("kda", True), ("kda_gva", False),
        ("kda_gva", True), ("kda_gate", False), ("kda_gate", True), ("kda_gate_init", False), ("kda_gate_init", True)]
    assert lists[4] == [dict(op="kda", T=1000, varlen=True, tensor=None, error="RuntimeError: boom")]
    assert [r["varlen"] for new in bench_ops.accuracy_pass(["gla"], 1000, False, device="cpu") for r in new] == [False] * 2


def test_accuracy_documents():
    """The accuracy pass's packed batch: several documents, none of a length that is a multiple
    of 64, exactly the requested tokens."""
    from scripts.benchlib import accuracy_doc_lengths

    assert accuracy_doc_lengths(1000) == [301, 21, 251, 427]
    for total in range(16, 5000):
        lengths = accuracy_doc_lengths(total)
        assert sum(lengths) == total and len(lengths) >= 4 and all(n > 0 and n % 64 for n in lengths), (total, lengths)


@pytest.mark.parametrize("group", ["gla", "kda", "kda_gva", "kda_gate", "kda_gate_init", "sdpa"])
def test_counts_of_every_case(bench_ops, group):
    for name, _ in bench_ops.CASES[group]:
        assert bench_ops._flops(name, 4096, False) > bench_ops._flops(name, 4096, True) > 0
        if name != "sdpa":
            assert bench_ops._bytes_moved(name, 4096, False) > bench_ops._bytes_moved(name, 4096, True) > 0


def test_bench_cp_lists_the_worst_ranks_kernels(monkeypatch):
    """bench_cp.py's per-kernel lines name, for each (op, D), the rank CP costs most (the
    larger of its pre-process share and its CP excess, which also sees what the local
    kernels do differently under CP), its longest kernels first, then the kernels whose time
    differs most between its CP call and its local call."""
    bench_cp = load_benchmark("bench_cp", monkeypatch)

    def row(op, r, f, b, excess_pct):
        return dict(op=op, layout="zigzag", D=2, rank=r, pre_fwd_kernel_ms=f, pre_bwd_kernel_ms=b, local_fwd_bwd_kernel_ms=1.0,
                    overhead_kernel_pct=100 * (f + b), cp_excess_kernel_pct=excess_pct,
                    pre_fwd_kernels=[("fwd_walk", f, 1)] if f else [],
                    pre_bwd_kernels=[("dhu_walk", b, 1), ("fold", 0.01, 3)])

    rows = [row("kda", 0, 0.3, 0.0, 40.0), row("kda", 1, 0.0, 0.5, 20.0),
            row("gla", 0, 0.05, 0.0, 12.0), row("gla", 1, 0.0, 0.08, 9.0)]
    assert [bench_cp.cp_cost_pct(r) for r in rows] == pytest.approx([40.0, 50.0, 12.0, 9.0])
    local = [("state_pass", 0.4, 1), ("output", 0.3, 2), ("cumsum", 0.1, 1)]
    cp = [("state_pass", 0.45, 1), ("dhu_walk", 0.5, 1), ("output", 0.3, 2)]
    rows[2]["cp_excess_kernels"] = bench_cp.kernel_excess(cp, local)
    assert rows[2]["cp_excess_kernels"] == [("dhu_walk", 0.5, 1), ("cumsum", -0.1, -1),
                                            ("state_pass", pytest.approx(0.05), 0), ("output", 0.0, 0)]
    text = bench_cp.worst_rank_kernels(rows)
    assert text == ("- kda zigzag D=2 rank 1 pre bwd: dhu_walk 0.500 ms x1, fold 0.010 ms x3\n"
                    "- gla zigzag D=2 rank 0 pre fwd: fwd_walk 0.050 ms x1\n"
                    "- gla zigzag D=2 rank 0 pre bwd: dhu_walk 0.000 ms x1, fold 0.010 ms x3\n"
                    "- gla zigzag D=2 rank 0 CP call minus local call: dhu_walk +0.500 ms +1, cumsum -0.100 ms -1, "
                    "state_pass +0.050 ms +0, output +0.000 ms +0\n"), text


@pytest.mark.gpu
def test_launch_sequence_shows_both_launches_of_a_split_kernel():
    """tune_launch --sequence: one warm kda_gate call lists its launches in order, the
    split kernels' dot launch followed by their `_exact` launch, each with a positive time."""
    tune_launch = load_tool("tune_launch")
    from scripts.benchlib import warm_fwd_bwd_step

    launches = tune_launch.launch_sequence(warm_fwd_bwd_step("kda_gate", 256))
    names = [name for name, _ in launches]
    assert all(ms > 0 for _, ms in launches)
    for kernel in ("chunk_kda_fwd_kernel_intra", "chunk_kda_bwd_kernel_intra"):
        first = names.index(kernel)
        assert names[first + 1] == f"{kernel}_exact", names[first:first + 2]


@pytest.mark.interpreter
@pytest.mark.multirank
@pytest.mark.slow
def test_bench_cp_smoke_checks_every_rank(monkeypatch, tmp_path):
    """bench_cp.py end to end at tiny sizes, D=3 (a rank that receives no state, one that
    both receives and sends, one that sends no state; under zigzag, ranks of two parts): it
    captures each rank's pre-process calls (a KDA rank takes one of two alternatives per
    direction, once per part) and its output and gradients match the single-rank run."""
    bench_cp = load_benchmark("bench_cp", monkeypatch)
    out = tmp_path / "cp.json"
    monkeypatch.setattr(sys, "argv", ["bench_cp.py", "--smoke", "--ops", "kda", "gla", "--degrees", "3", "--T", "150",
                                      "--H", "1", "--K", "16", "--V", "16", "--json", str(out)])
    bench_cp.main()
    rows = json.loads(out.read_text())["rows"]
    assert sorted((r["op"], r["layout"], r["rank"]) for r in rows) == [
        (op, layout, r) for op in ("gla", "kda") for layout in ("contiguous", "zigzag") for r in range(3)]
    assert all(r["max_rel_err"] < 1e-5 for r in rows), [(r["op"], r["rank"], r["max_rel_err"]) for r in rows]


@pytest.mark.interpreter
def test_bench_walks_smoke_checks_every_setting(capsys):
    """tools/bench_walks --smoke (CPU, no timing): every (BV, segments) setting's messages agree
    with the plain walk, one table row each."""
    bench_walks = load_tool("bench_walks")
    bench_walks.main(["--smoke", "--BV", "16", "32", "--warps", "4", "--segments", "1", "2", "5"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 |")]
    assert [(row[1], row[3]) for row in rows] == [("16", "1"), ("16", "2"), ("16", "5"),
                                                  ("32", "1"), ("32", "2"), ("32", "5")]


def test_profile_ncu_tabulates_a_details_report():
    """tools/profile_ncu reads ncu's `--csv --page details` report (messages before its header
    skipped, durations in any unit, numbers with thousands separators, a later section's metric
    of the same name ignored) and merges the launches of one kernel: durations summed, the other metrics weighted by duration."""
    profile_ncu = load_tool("profile_ncu")
    child = profile_ncu.ncu_command("ncu", "kda", "ours", 256, Path("r.csv"))
    assert child[child.index(sys.executable):] == [sys.executable, "-m", "scripts.tools.profile_ncu", "--child",
                                                   "kda:ours", "--T", "256"]
    def stall(reason):
        return f"{profile_ncu.STALL_PREFIX}{reason}{profile_ncu.STALL_SUFFIX}"

    head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
            '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')

    def rows(launch, kernel, metrics):
        return [f'"{launch}","1","python","h","{kernel}","1","7","(128, 1, 1)","(8, 16, 1)","0","9.0","S",'
                f'"{name}","{unit}","{value}"' for name, unit, value in metrics]

    report = "\n".join(["==PROF== Connected to process 1", head]
                       + rows(0, "walk_kernel(int)", [("Duration", "msecond", "1.5"), ("DRAM Throughput", "%", "40"),
                                                      ("Registers Per Thread", "register/thread", "255"),
                                                      (stall("long_scoreboard"), "", "3"), (stall("barrier"), "", "1")])
                       + rows(1, "small", [("Duration", "usecond", "1,000"), ("DRAM Throughput", "%", "90"),
                                           ("Memory Throughput", "%", "91"),
                                           ("Memory Throughput", "byte/s", "1,166,078,569,147.24")])
                       + rows(2, "walk_kernel(int)", [("Duration", "nsecond", "500,000"), ("DRAM Throughput", "%", "80"),
                                                      ("Registers Per Thread", "register/thread", "255"),
                                                      (stall("long_scoreboard"), "", "7"), (stall("wait"), "", "2")]))
    launches = profile_ncu.parse_details(report)
    assert [(d["kernel"], d["Duration"]) for d in launches] == [("walk_kernel(int)", 1500.0), ("small", 1000.0),
                                                                ("walk_kernel(int)", 500.0)]
    assert launches[1]["Memory Throughput"] == 91.0  # Memory Workload Analysis's byte/s twin is skipped
    walk, small = profile_ncu.summarise(launches)
    assert (walk["kernel"], walk["launches"], walk["us"], small["us"]) == ("walk_kernel", 2, 2000.0, 1000.0)
    assert walk["DRAM %"] == pytest.approx((40 * 1500 + 80 * 500) / 2000) and walk["regs"] == pytest.approx(255)
    assert walk["stalls"] == [("long_scoreboard", pytest.approx(4.0)), ("barrier", pytest.approx(0.75))]
    table = profile_ncu.markdown("kda:ours", [walk, small])
    assert "| walk_kernel | 2 | 2000.0 | 50 |" in table and "Total: 3.000 ms" in table
    with pytest.raises(ValueError, match="no ncu details table"):
        profile_ncu.parse_details("==ERROR== something failed")
