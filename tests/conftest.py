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


def diagonal_block_excess(b: torch.Tensor, block: int = 16) -> torch.Tensor:
    """For the chunk-local gate cumsum b `[L, H, K]` of one chunk, per `block`-token diagonal
    block and head, the largest |b - b_mid| over its rows and keys, mid the block's middle row
    (clipped to the chunk): `[cdiv(L, block), H]`, what the kernels compare with the dot path's
    span limit (cp_linattn/ops/common/intra.py)."""
    rows = []
    for r in range(0, b.shape[0], block):
        mid = min(r + block // 2, b.shape[0] - 1)
        rows.append((b[r:r + block] - b[mid:mid + 1]).abs().amax(dim=(0, 2)))
    return torch.stack(rows)


def diagonal_block_spans(g: torch.Tensor, chunk: int = 64, block: int = 16) -> torch.Tensor:
    """Per chunk (of one row, all heads and keys), the largest `diagonal_block_excess` of the
    log gate g's chunk-local cumsum: what decides between the dot and the exact path of the diagonal
    blocks."""
    T = g.shape[1]
    chunks = (g[0, c0:c0 + chunk].float().cumsum(0) for c0 in range(0, T, chunk))
    return torch.tensor([diagonal_block_excess(b.reshape(b.shape[0], 1, -1), block).max().item() for b in chunks])


def set_tile_caps(monkeypatch: pytest.MonkeyPatch, prefixes: tuple[str, ...], caps: dict[str, int]) -> None:
    """Sets the BK / BV caps of every entry of ops/launch.py whose kernel name starts with one
    of `prefixes` (those that have the key) for one test."""
    from cp_linattn.ops.launch import LAUNCH

    for kernel, entry in LAUNCH.items():
        if kernel.startswith(prefixes):
            for key, cap in caps.items():
                if key in entry:
                    monkeypatch.setitem(entry, key, cap)
