import os

import torch

# The Triton interpreter must be chosen before triton is first imported; without a GPU it is
# the only way our kernels run, so the CPU test suite always uses it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
