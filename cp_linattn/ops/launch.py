"""Launch settings of every Triton kernel: tile-size caps, warps and software-pipeline stages.

One table, keyed by launcher name (the kernel `<op>_<fwd|bwd>_kernel_<what>` is launched by
`<op>_<fwd|bwd>_<what>`, whose entry this is; a kernel run twice, once for the dot path and once
for the exact diagonal blocks, has a second entry `<launcher>_exact` and shows in a profiler
trace as `<kernel>_exact`): one grep leads from a trace to its settings and back. One table
so that `scripts/tools/tune_launch.py` can sweep the values on a GPU without touching the
kernels, and the values in use are visible in one place; they are the ones tuned with it.
`BK`/`BV` are upper bounds (`BC`: chunks per program): a launcher uses
`min(cap, next_power_of_2(head dim))`, never below 16 (tl.dot needs it). The Triton
interpreter ignores warps and stages, so the CPU tests run the same tiles as the GPU.
Every kernel is launched through `launch_kernel`, which applies the entry and steps the stages
down where the device's shared memory cannot hold them (large head dims).
"""
from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import triton
from triton.runtime.errors import OutOfResources

LAUNCH: dict[str, dict[str, int]] = {
    # Sequential state recurrences (one program per state tile walks all chunks): small
    # value tiles give more programs, which is what hides the per-chunk latency.
    "chunk_fwd_h": dict(BK=32, BV=32, num_warps=4, num_stages=3),
    "chunk_bwd_dh": dict(BK=64, BV=32, num_warps=8, num_stages=3),
    # Chunk-parallel, memory-bound: the late correction of a sequence's states under CP. BC
    # chunks per program share one read of the fp32 state tile, which read once per chunk
    # would move more bytes than the bf16 states it corrects.
    "add_decayed_state": dict(BK=64, BV=64, BC=4, num_warps=4, num_stages=1),
    # The merge of the CP ranks' boundary states: full K rows per program (KDA's K x K dot);
    # two stages prefetch the next transition.
    "fold_states": dict(BV=32, num_warps=8, num_stages=2),
    "chunk_delta_rule_fwd_h": dict(BV=16, num_warps=4, num_stages=3),
    "chunk_delta_rule_bwd_dhu": dict(BV=16, num_warps=4, num_stages=3),
    # The same kernels on a KDA middle rank's fragment under CP, walked in segments side by
    # side (cp_linattn/cp/kda.py): wide tiles read each head's K-wide inputs fewer times,
    # and the segments give back the programs they remove.
    "cp_fwd_fragment_h": dict(BV=64, num_warps=4, num_stages=3),
    "cp_bwd_fragment_dhu": dict(BV=64, num_warps=4, num_stages=3),
    # The kernels launched twice (dot and exact diagonal blocks, cp_linattn/ops/common/intra.py)
    # have an entry per launch, the exact one under `<launcher>_exact` (`exact_path_key`).
    # Chunk-parallel GLA kernels: a V tile as wide as the head builds the intra-chunk
    # scores once per chunk instead of once per V tile.
    "chunk_gla_fwd_o": dict(BK=64, BV=128, num_warps=4, num_stages=2),
    "chunk_gla_fwd_o_exact": dict(BK=64, BV=128, num_warps=4, num_stages=2),
    "chunk_gla_bwd_dv": dict(BK=64, BV=128, num_warps=8, num_stages=2),
    "chunk_gla_bwd_dqkg": dict(BK=64, BV=64, num_warps=8, num_stages=1),
    "chunk_gla_bwd_dqkg_exact": dict(BK=64, BV=64, num_warps=8, num_stages=1),
    "chunk_kda_fwd_intra": dict(BK=32, BV=64, num_warps=2, num_stages=1),
    "chunk_kda_fwd_intra_exact": dict(BK=32, BV=64, num_warps=2, num_stages=1),
    "chunk_kda_fwd_o": dict(BK=64, BV=128, num_warps=4, num_stages=1),
    "chunk_kda_bwd_dAv": dict(BV=64, num_warps=4, num_stages=2),
    "chunk_kda_bwd_wy_dqkg": dict(BK=64, BV=64, num_warps=8, num_stages=1),
    "chunk_kda_bwd_intra": dict(BK=64, num_warps=2, num_stages=1),
    "chunk_kda_bwd_intra_exact": dict(BK=64, num_warps=2, num_stages=1),
    # Sequential walks whose parallelism comes from cutting the sequence into segments
    # (fused_chunk.segment_count, sized from the forward's tiles): wide tiles read each
    # chunk's inputs fewer times.
    "fused_chunk_gla_fwd": dict(BK=128, BV=128, num_warps=4, num_stages=2),
    "fused_chunk_gla_bwd": dict(BK=64, BV=128, num_warps=4, num_stages=2),
    # Elementwise passes over the gate and q/k: Triton's defaults, untuned (they are small).
    "chunk_local_cumsum": dict(num_warps=4, num_stages=3),
    "kda_gate_fwd_cumsum": dict(num_warps=4, num_stages=3),
    "kda_gate_bwd_cumsum": dict(num_warps=4, num_stages=3),
    "l2norm_fwd": dict(num_warps=4, num_stages=3),
    "l2norm_bwd": dict(num_warps=4, num_stages=3),
}

_BLOCK_KEYS = ("BK", "BV", "BC")


def launch_options(kernel: str) -> dict[str, int]:
    """The `num_warps`/`num_stages` keyword arguments of `kernel`'s launch."""
    return {k: v for k, v in LAUNCH[kernel].items() if k not in _BLOCK_KEYS}


# (launcher, device, constexpr arguments) -> the pipeline stages that fit the device's shared memory
_FITTED_STAGES: dict[tuple, int] = {}


def launch_kernel(kernel, grid, launcher: str, *args, **meta) -> None:
    """`kernel[grid](*args, **meta)` with the warps and stages of `launcher`'s LAUNCH entry.

    Where the device's shared memory cannot hold the entry's pipeline stages for these
    arguments (large head dims: a `[64, 256]` bf16 tile is 32 KiB per stage and operand), the
    launch is retried with one stage fewer, down to one, and the count that fits is kept for
    the next call with the same constexpr arguments on the same device (one failed compile
    per configuration, on the first call). If one stage does not fit either, the
    OutOfResources names the launcher and its entry.
    """
    options = {"num_stages": 3, **launch_options(launcher)}  # 3: Triton's default, where an entry has none
    key = None
    if _FITTED_STAGES:  # some configuration did not fit: look this one up (none did: no cost)
        key = _fitting_key(launcher, meta)
        options["num_stages"] = _FITTED_STAGES.get(key, options["num_stages"])
    while True:
        try:
            kernel[grid](*args, **meta, **options)
            return
        except OutOfResources as e:
            if options["num_stages"] <= 1:
                raise OutOfResources(e.required, e.limit, f"{e.name} (launcher {launcher}, LAUNCH entry "
                                     f"{LAUNCH[launcher]}, at one stage: lower its BK/BV caps in "
                                     f"cp_linattn/ops/launch.py)") from e
            options["num_stages"] -= 1
            _FITTED_STAGES[key or _fitting_key(launcher, meta)] = options["num_stages"]


def _fitting_key(launcher: str, meta: dict) -> tuple:
    """A launch's entry in _FITTED_STAGES: launcher, device and constexpr arguments."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else -1
    return launcher, device, tuple(sorted((k, v) for k, v in meta.items() if isinstance(v, (bool, int, float, str))))


def exact_path_key(launcher: str, exact: bool) -> str:
    """The entry of one launch of a kernel run twice: the exact-diagonal launch has its own."""
    return f"{launcher}_exact" if exact else launcher


def jit_traced_as(flag: str, name_when_set: str) -> Callable:
    """`triton.jit` for a kernel whose `tl.constexpr` `flag` selects one of two launches: the
    compiled kernel is named `name_when_set` when the flag is true and keeps its own name
    otherwise, so a profiler trace tells the two launches apart."""
    def decorate(fn):
        position = list(inspect.signature(fn).parameters).index(flag)

        def name(specialization) -> str:
            constants = specialization.constants  # keyed by name or by (position,), per Triton version
            return name_when_set if constants.get(flag, constants.get((position,), False)) else fn.__name__

        return triton.jit(fn, repr=name)
    return decorate


def tile(kernel: str, key: str, dim: int) -> int:
    """Tile size along a head dim of `dim` elements: a power of two in [16, cap]."""
    return max(16, min(LAUNCH[kernel][key], triton.next_power_of_2(dim)))


def tiles(kernel: str, K: int, V: int) -> tuple[int, int]:
    """(BK, BV) of a kernel tiling both head dims."""
    return tile(kernel, "BK", K), tile(kernel, "BV", V)
