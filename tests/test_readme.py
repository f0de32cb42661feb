"""The README's front door: the install commands, the API example run as written on a CPU-only
machine (`import cp_linattn` picks the Triton interpreter itself), the license."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cp_linattn

README = Path(__file__).resolve().parents[1] / "README.md"
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="what a CPU-only machine does")


def python(code: str, **env: str) -> subprocess.CompletedProcess:
    """`python -c code` from the repository root, without the TRITON_INTERPRET the tests set."""
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code], cwd=README.parent, capture_output=True, text=True, timeout=300,
                          env={**base, "PYTHONPATH": str(README.parent), **env})


def test_install_takes_the_cpu_torch_first():
    install = README.read_text().split("## Install", 1)[1].split("## ", 1)[0]
    block = re.findall(r"```bash\n(.*?)```", install, re.S)[0].splitlines()
    assert block[0] == "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    assert block[1].startswith("pip install -e .")


@cpu_only
@pytest.mark.interpreter
def test_api_example_runs_as_written():
    """Every python block of the API section, in order, in a fresh process with no
    TRITON_INTERPRET: the example starts its own group of one."""
    api = README.read_text().split("## API", 1)[1]
    code = "\n".join(re.findall(r"```python\n(.*?)```", api.split("## Layout", 1)[0], re.S))
    checks = """
assert os.environ["TRITON_INTERPRET"] == "1"
assert o.shape == (1, 20, 2, 32)
o_gla, _ = chunk_gla(q, k, v, g, cu_seqlens=cu_seqlens)
assert torch.allclose(o_local, o_gla, atol=1e-5)  # one rank owns the whole batch
assert x.shape == (1, 20, 64) and ctx.layout == "zigzag"  # the hybrid example ran
print("ran")
"""
    out = python(code + "\nimport os\n" + checks)
    assert out.returncode == 0 and out.stdout == "ran\n", out.stderr[-3000:]


@cpu_only
@pytest.mark.interpreter
def test_import_selects_the_interpreter():
    """A value the user set is kept; triton imported first (its own jit functions already
    compiled-mode) gets a warning that says what to do, and the variable is left alone."""
    out = python("import torch, os, cp_linattn\n"
                 "q, k, v = (torch.randn(1, 8, 1, 16) for _ in range(3))\n"
                 "o, _ = cp_linattn.chunk_gla(q, k, v, torch.full((1, 8, 1, 16), -0.1))\n"
                 "print(os.environ['TRITON_INTERPRET'], tuple(o.shape))")
    assert out.returncode == 0 and out.stdout == "1 (1, 8, 1, 16)\n", out.stderr[-3000:]
    out = python("import os, cp_linattn; print(os.environ['TRITON_INTERPRET'])", TRITON_INTERPRET="0")
    assert out.returncode == 0 and out.stdout == "0\n", out.stderr[-3000:]
    out = python("import os, triton, cp_linattn; print(os.environ.get('TRITON_INTERPRET'))")
    assert out.returncode == 0 and out.stdout == "None\n", out.stderr[-3000:]
    assert "triton was imported before cp_linattn without TRITON_INTERPRET=1" in out.stderr
    assert "Import cp_linattn first, or set TRITON_INTERPRET=1 before importing triton" in out.stderr


def test_numpy_warning_names_the_bad_pair(monkeypatch):
    import numpy
    import triton

    monkeypatch.setattr(numpy, "__version__", "2.4.1")
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    with pytest.warns(UserWarning, match=r"numpy 2.4.1 with triton 3.6.0: .* 'numpy<2.4' or 'triton>=3.8'"):
        cp_linattn._check_interpreter_numpy()
    monkeypatch.setattr(triton, "__version__", "3.8.0")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cp_linattn._check_interpreter_numpy()


def test_license_matches_pyproject():
    pyproject = (README.parent / "pyproject.toml").read_text()  # tomllib is 3.11+, the package 3.10+
    assert re.search(r"^license = (.*)$", pyproject, re.M).group(1) == '{ text = "MIT" }'
    assert (README.parent / "LICENSE").read_text().startswith("MIT License\n")


def test_layout_and_tool_commands_name_existing_scripts():
    """The Layout's scripts lines and the commands of scripts/tools/README.md name files that
    exist, and every script is listed: the user benchmarks in scripts/, the tools in scripts/tools/."""
    root = README.parent
    layout = README.read_text().split("## Layout", 1)[1].split("```")[1]
    lines = {line.split()[0]: line for line in layout.strip().splitlines() if line.startswith("scripts/")}
    assert set(lines) == {"scripts/", "scripts/tools/"}, lines
    for folder, line in lines.items():
        named = set(re.findall(r"\b(\w+)(?:\.py)?\b", line.split(None, 1)[1])) & {
            p.stem for p in (root / folder).glob("*.py")}
        assert named == {p.stem for p in (root / folder).glob("*.py")} - {"__init__"}, (folder, named)
    tools = (root / "scripts" / "tools" / "README.md").read_text()
    commands = re.findall(r"python -m scripts\.tools\.(\w+)", tools)
    assert set(commands) == {p.stem for p in (root / "scripts" / "tools").glob("*.py")} - {"__init__"}
    for script in re.findall(r"python (scripts/\w+\.py)", tools):
        assert (root / script).is_file(), script
