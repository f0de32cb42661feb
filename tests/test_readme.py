"""The README's API example runs as written (one gloo rank stands in for the process group)."""
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.interpreter
def test_api_example_runs(tmp_path):
    api = README.read_text().split("## API", 1)[1]
    code = "\n".join(re.findall(r"```python\n(.*?)```", api.split("## Layout", 1)[0], re.S))  # every block, in order
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        scope: dict = {}
        exec(compile(code, str(README), "exec"), scope)
    finally:
        dist.destroy_process_group()
    assert scope["o"].shape == (1, 20, 2, 32)
    o_gla, _ = scope["chunk_gla"](*(scope[n] for n in ("q", "k", "v", "g")), cu_seqlens=scope["cu_seqlens"])
    # one rank owns the whole batch, so its CP output is the single-rank output
    assert torch.allclose(scope["o_local"], o_gla, atol=1e-5)
    assert scope["x"].shape == (1, 20, 64) and scope["ctx"].layout == "zigzag"  # the hybrid example ran


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
