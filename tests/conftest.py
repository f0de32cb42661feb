"""pytest hooks only; the helpers the tests share are in tests/utils.py.

Markers (registered in pyproject.toml):
- `gpu`: needs a CUDA GPU; skipped without one.
- `interpreter`: runs Triton kernels on CPU tensors in the Triton interpreter. With a GPU,
  Triton compiles for it and cannot run kernels on CPU tensors, so these are skipped unless
  TRITON_INTERPRET=1: run them with CUDA_VISIBLE_DEVICES='' (as CI does, on a CPU machine).
- `multirank`: spawns gloo process groups (tests/multirank.py, torchrun).
- `slow`: left out of the contributors' fast subset, `python -m pytest -m "not slow"`.
"""
import os

import torch

# The Triton interpreter must be chosen before triton is first imported; without a GPU it is
# the only way our kernels run, so the CPU test suite always uses it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = torch.cuda.is_available()
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_interpreter = pytest.mark.skip(reason="CPU interpreter test; run with CUDA_VISIBLE_DEVICES='' for these")
    for item in items:
        if not cuda and item.get_closest_marker("gpu"):
            item.add_marker(skip_gpu)
        if cuda and not interpreting and item.get_closest_marker("interpreter"):
            item.add_marker(skip_interpreter)
