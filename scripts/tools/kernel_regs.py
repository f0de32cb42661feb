"""Registers and spills of the KDA and GLA chunk kernels for the H200 (sm_90a), without a GPU.

Compiles each kernel with the launch settings of `cp_linattn/ops/launch.py` for the
benchmark's shapes (bf16, H=16, K=V=128) through Triton's front end and its bundled
`ptxas -v`, and prints what ptxas reports. The spill figures are static (bytes per thread
of spill instructions anywhere in the kernel, taken or not), a first check of a change's
register pressure before it is timed on the GPU.

Needs a Triton of the GPU machine's version (3.6.0 there) with its NVIDIA backend; from the
repository root, with DIR any folder outside the checkout:

    pip install --no-deps --target DIR triton==3.6.0
    PYTHONPATH=DIR python -m scripts.tools.kernel_regs --HV 16 32
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from cp_linattn.ops.gla.chunk import chunk_gla_bwd_kernel_dqkg, chunk_gla_fwd_kernel_o
from cp_linattn.ops.kda.chunk_bwd import chunk_kda_bwd_kernel_intra
from cp_linattn.ops.kda.wy import CHUNK_SIZE, SUB_CHUNK_SIZE, chunk_kda_fwd_kernel_intra
from cp_linattn.ops.launch import LAUNCH, exact_path_key, launch_options

H, K, V = 16, 128, 128
# Argument types by name (bf16 inputs and outputs, fp32 gate cumsum, chunk matrices and KDA's
# partial gradients); GLA's own differences in its entries below.
TYPES = {
    "q": "*bf16", "k": "*bf16", "v": "*bf16", "beta": "*bf16", "w": "*bf16", "u": "*bf16", "qg": "*bf16",
    "kg": "*bf16", "dq_out": "*bf16", "dk_out": "*bf16", "dbeta_out": "*bf16", "o": "*bf16", "A": "*bf16",
    "h": "*bf16", "do": "*bf16",
    "gk": "*fp32", "Aqk": "*fp32", "Akk": "*fp32", "dS": "*fp32", "dL": "*fp32", "dq": "*fp32", "dk": "*fp32",
    "dg": "*fp32", "dbeta": "*fp32", "dh": "*fp32",
    "exact_blocks": "*i32", "cu_seqlens": "*i64", "chunk_indices": "*i32", "scale": "fp32", "T": "i32",
}
GLA_TYPES = {"dq": "*bf16", "dk": "*bf16", "dg": "*bf16"}


def _tiles(kernel: str) -> dict:
    return {n: LAUNCH[kernel][n] for n in ("BK", "BV") if n in LAUNCH[kernel]}


# kernel -> (jit function, constexprs for HV value heads and a launch's LAUNCH entry, argument types)
KERNELS = {
    "chunk_kda_fwd_intra": (chunk_kda_fwd_kernel_intra,
                            lambda HV, entry: dict(H=H, HV=HV, K=K, V=V, BT=CHUNK_SIZE, BC=SUB_CHUNK_SIZE,
                                                   **_tiles(entry), COMPUTE_A=True, COMPUTE_U=True), TYPES),
    "chunk_kda_bwd_intra": (chunk_kda_bwd_kernel_intra,
                            lambda HV, entry: dict(H=H, HV=HV, K=K, BT=CHUNK_SIZE, BC=SUB_CHUNK_SIZE, **_tiles(entry)),
                            TYPES),
    "chunk_gla_fwd_o": (chunk_gla_fwd_kernel_o,
                        lambda HV, entry: dict(H=H, K=K, V=V, BT=CHUNK_SIZE, BC=SUB_CHUNK_SIZE, **_tiles(entry)),
                        {**TYPES, **GLA_TYPES}),
    "chunk_gla_bwd_dqkg": (chunk_gla_bwd_kernel_dqkg,
                           lambda HV, entry: dict(H=H, K=K, V=V, BT=CHUNK_SIZE, BC=SUB_CHUNK_SIZE, **_tiles(entry)),
                           {**TYPES, **GLA_TYPES}),
}


def ptxas_report(kernel: str, HV: int, varlen: bool, exact: bool) -> str:
    fn, constexprs, types = KERNELS[kernel]
    entry = exact_path_key(kernel, exact)
    const = dict(constexprs(HV, entry), IS_VARLEN=varlen, DOT_PRECISION="tf32", EXACT_DIAGONAL=exact)
    names = list(fn.arg_names)
    signature = {n: "constexpr" if n in const else types[n] for n in names}
    src = ASTSource(fn, signature, constexprs={(names.index(n),): v for n, v in const.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=launch_options(entry))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    out = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                         capture_output=True, text=True, check=True)
    os.unlink(f.name)
    return "; ".join(line.split(":", 1)[-1].strip() for line in out.stderr.splitlines()
                     if "registers" in line or "spill" in line)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    p.add_argument("--HV", type=int, nargs="+", default=[16], help="value heads (H = 16; 32 is GVA)")
    args = p.parse_args()
    print(f"triton {triton.__version__}, sm_90a, bf16, H={H}, K=V={K}")
    for kernel in args.kernels:
        for HV in args.HV if "kda" in kernel else args.HV[:1]:
            for varlen in (False, True):
                for exact in (False, True):
                    name = f"{kernel} HV={HV}{' varlen' if varlen else ''} {'exact' if exact else 'dot'} diagonal"
                    print(f"{name}: {ptxas_report(kernel, HV, varlen, exact)}", flush=True)


if __name__ == "__main__":
    main()
