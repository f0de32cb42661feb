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
