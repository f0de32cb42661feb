import os

import torch

# The Triton interpreter must be chosen before triton is first imported; without a GPU it is
# the only way our kernels run, so the CPU test suite always uses it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _is_gpu_test(item: pytest.Item) -> bool:
    return any(m.kwargs.get("reason") == requires_cuda.kwargs["reason"] for m in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With a GPU, Triton compiles for it and cannot run kernels on CPU tensors, so the CPU
    (interpreter) tests cannot run in the same process: run them with CUDA_VISIBLE_DEVICES=''
    (as CI does). Without a GPU the GPU tests skip through `requires_cuda`."""
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="CPU interpreter test; run with CUDA_VISIBLE_DEVICES='' for these")
    for item in items:
        if not _is_gpu_test(item):
            item.add_marker(skip)


def diagonal_block_spans(g: torch.Tensor, chunk: int = 64, block: int = 16) -> torch.Tensor:
    """Per chunk (of one row, all heads), the largest |b - b_mid| over its 16-token blocks,
    b the chunk-local gate cumsum and mid each block's middle row: what decides between the
    dot and the column path of the diagonal blocks (cp_linattn/ops/common/intra.py)."""
    T = g.shape[1]
    spans = []
    for c0 in range(0, T, chunk):
        b = g[0, c0:c0 + chunk].float().cumsum(0)
        worst = 0.0
        for r in range(0, b.shape[0], block):
            mid = min(r + block // 2, b.shape[0] - 1)
            worst = max(worst, (b[r:r + block] - b[mid]).abs().max().item())
        spans.append(worst)
    return torch.tensor(spans)


def set_tile_caps(monkeypatch: pytest.MonkeyPatch, prefixes: tuple[str, ...], caps: dict[str, int]) -> None:
    """Sets the BK / BV caps of every entry of ops/launch.py whose kernel name starts with one
    of `prefixes` (those that have the key) for one test."""
    from cp_linattn.ops.launch import LAUNCH

    for kernel, entry in LAUNCH.items():
        if kernel.startswith(prefixes):
            for key, cap in caps.items():
                if key in entry:
                    monkeypatch.setitem(entry, key, cap)
