"""cp_linattn: context-parallel linear attention (GLA, KDA) with chunked Triton kernels.

Without a CUDA device, importing cp_linattn sets TRITON_INTERPRET=1 (unless it is already set,
to anything), so the kernels run on CPU tensors in Triton's interpreter, the only way they run
there. Triton makes each @triton.jit function interpreted or compiled when it is defined, its
own library functions (tl.sum's combine, ...) when triton is imported: so this must happen
before triton's first import. If triton was imported already, cp_linattn warns and leaves the
variable alone (setting it then mixes the two modes, which fails inside the kernels).
"""
import os as _os
import sys as _sys


def _select_triton_mode() -> None:
    if "TRITON_INTERPRET" in _os.environ:  # the user's choice, "0" included
        return
    import torch

    if torch.cuda.is_available():
        return
    if "triton" in _sys.modules:
        import warnings

        warnings.warn("no CUDA device, and triton was imported before cp_linattn without TRITON_INTERPRET=1: "
                      "the kernels cannot run. Import cp_linattn first, or set TRITON_INTERPRET=1 before "
                      "importing triton", stacklevel=3)
        return
    _os.environ["TRITON_INTERPRET"] = "1"


def _check_interpreter_numpy() -> None:
    """numpy >= 2.4 breaks Triton < 3.8's interpreter (its tensors' __index__, so `range()` over
    a runtime bound: triton-lang/triton#9171; seen with 3.6, fixed in 3.8): say so up front."""
    import warnings

    try:
        import numpy
        import triton
    except ImportError:  # no triton (not Linux): the references still work, the kernels cannot run
        return

    def version(module) -> tuple[int, int]:
        return tuple(int(x) for x in module.__version__.split(".")[:2])

    if version(numpy) >= (2, 4) and version(triton) < (3, 8):
        warnings.warn(f"numpy {numpy.__version__} with triton {triton.__version__}: the Triton interpreter (the CPU "
                      "path) fails on loops over runtime bounds; install 'numpy<2.4' or 'triton>=3.8'", stacklevel=3)


_select_triton_mode()
if _os.environ.get("TRITON_INTERPRET") == "1":
    _check_interpreter_numpy()

# the kernels are defined by these imports, so only now (E402 on purpose)
from cp_linattn.cp import FLACPContext, build_cp_context, shard, unshard
from cp_linattn.ops.gla.chunk import chunk_gla
from cp_linattn.ops.gla.fused_chunk import fused_chunk_gla
from cp_linattn.ops.gla.naive import naive_recurrent_gla
from cp_linattn.ops.kda.chunk import chunk_kda
from cp_linattn.ops.kda.naive import kda_gate, kda_lower_bound_gate, naive_recurrent_kda

__version__ = "0.1.0"

__all__ = [
    "chunk_gla",
    "fused_chunk_gla",
    "chunk_kda",
    "build_cp_context",
    "FLACPContext",
    "shard",
    "unshard",
    "naive_recurrent_gla",
    "naive_recurrent_kda",
    "kda_gate",
    "kda_lower_bound_gate",
]
