"""The README's API example runs as written (one gloo rank stands in for the process group)."""
import re
from pathlib import Path

import torch
import torch.distributed as dist

README = Path(__file__).resolve().parents[1] / "README.md"


def test_api_example_runs(tmp_path):
    api = README.read_text().split("## API", 1)[1]
    code = re.search(r"```python\n(.*?)```", api, re.S).group(1)
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
