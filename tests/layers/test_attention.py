"""SoftmaxAttention: document masking, GQA and RoPE against a per-document reference, the flex
block mask against the dense mask, argument errors, and CP (K/V all-gather) over 2-4 ranks in
the contiguous, zigzag and explicit-ranges layouts equal to the single-rank run."""
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from cp_linattn.cp.attention import (document_block_mask, document_causal_attention, document_mask, gather_index,
                                     local_plan, plan_from_ranges, resolve_kernel)
from cp_linattn.layers import SoftmaxAttention
from cp_linattn.layers.attention import rotary
from tests.multirank import run_ranks

D = 32
REPO = Path(__file__).resolve().parents[2]


def _make(H: int = 4, Hkv: int = 2, rope: float | None = 10000.0) -> SoftmaxAttention:
    torch.manual_seed(0)
    return SoftmaxAttention(D, H, Hkv, head_dim=8, head_v_dim=6, rope_theta=rope)


def _inputs(T: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x and the probe of the loss sum(out * probe), both `[1, T, D]`."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, T, D, generator=gen), torch.randn(1, T, D, generator=gen)


def _run(module, x, probe, **kw):
    """Forward, backward of sum(out * probe): (out, dx, {param: grad})."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out = module(x, **kw)
    (out * probe).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


def _reference(module: SoftmaxAttention, x: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """The layer written out per document: explicit scores, causal mask, softmax, GQA by
    repeating key heads, RoPE positions from the document's start."""
    H, Hkv, Dk, Dv = module.n_heads, module.n_kv_heads, module.head_dim, module.head_v_dim
    outs = []
    for s, e in zip(cu[:-1], cu[1:]):
        xs = x[:, s:e]
        n = e - s
        q = module.q_proj(xs).view(1, n, H, Dk)
        k = module.k_proj(xs).view(1, n, Hkv, Dk)
        v = module.v_proj(xs).view(1, n, Hkv, Dv)
        if module.rope_theta is not None:
            q, k = rotary(q, torch.arange(n), module.rope_theta), rotary(k, torch.arange(n), module.rope_theta)
        k, v = k.repeat_interleave(H // Hkv, dim=2), v.repeat_interleave(H // Hkv, dim=2)
        scores = torch.einsum("bihd,bjhd->bhij", q, k) * Dk ** -0.5
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        outs.append(module.o_proj(torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v).reshape(1, n, H * Dv)))
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("H,Hkv,rope", [(4, 2, 10000.0), (2, 2, None), (4, 1, 500.0)])
def test_matches_per_document_reference(H, Hkv, rope):
    """Packed varlen batch = the explicit per-document computation, forward and gradients;
    a document alone = the same document packed (RoPE restarts at every document)."""
    cu = [0, 17, 18, 40, 40, 63]
    module = _make(H, Hkv, rope)
    x, probe = _inputs(cu[-1])
    out, dx, grads = _run(module, x, probe, cu_seqlens=torch.tensor(cu))
    xr = x.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    ref = _reference(module, xr, cu)
    (ref * probe).sum().backward()
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx, xr.grad, rtol=1e-5, atol=1e-6)
    for name, p in module.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)
    alone = module(x[:, 18:40])
    torch.testing.assert_close(out[:, 18:40], alone.detach(), rtol=1e-5, atol=1e-6)


def test_rotary_scores_depend_on_relative_position():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8, generator=gen), torch.randn(1, 1, 1, 8, generator=gen)

    def score(m: int, n: int) -> torch.Tensor:
        return (rotary(q, torch.tensor([m]), 100.0) * rotary(k, torch.tensor([n]), 100.0)).sum()

    torch.testing.assert_close(score(7, 3), score(1004, 1000))
    torch.testing.assert_close(rotary(q, torch.tensor([0]), 100.0), q)
    assert not torch.allclose(score(7, 3), score(7, 4))


# each rank's ranges of a packed batch: contiguous, zigzag-like, irregular; lengths not multiples of the block
LAYOUTS = {
    "contiguous": [[(0, 37)], [(37, 75)]],
    "zigzag": [[(0, 10), (66, 75)], [(10, 20), (57, 66)], [(20, 29), (48, 57)], [(29, 38), (38, 48)]],
    "irregular": [[(0, 5), (17, 30), (60, 75)], [(5, 17), (30, 60)]],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("block", [8, 16])
def test_block_mask_matches_dense_mask(layout, block):
    """The flex BlockMask computed from per-block bounds: its blocks (partial or full) are
    exactly those holding an allowed pair, its full blocks hold only allowed pairs, and flex
    with it (eager: dense, applying mask_mod) equals SDPA with the explicit mask."""
    cu = torch.tensor([0, 3, 21, 22, 50, 75])
    full_blocks = 0
    for rank in range(len(LAYOUTS[layout])):
        plan = plan_from_ranges(cu, LAYOUTS[layout], rank)
        L, T = plan.q_pos.numel(), plan.kv_len
        dense = document_mask(plan.q_pos, plan.q_lo, 0, T)  # [L, T]
        nq, nkv = -(-L // block), -(-T // block)
        padded = torch.zeros(nq * block, nkv * block, dtype=torch.bool)
        padded[:L, :T] = dense
        tiles = padded.view(nq, block, nkv, block)
        any_pair, all_pairs = tiles.any(3).any(1), tiles.all(3).all(1)  # [nq, nkv]
        bm = document_block_mask(plan.q_pos, plan.q_lo, T, block)
        assert torch.equal(bm.to_dense()[0, 0].bool(), any_pair), (layout, rank)
        full = torch.zeros(nq, nkv, dtype=torch.bool)
        for i in range(nq):
            full[i, bm.full_kv_indices[0, 0, i, : bm.full_kv_num_blocks[0, 0, i]].long()] = True
        assert not (full & ~all_pairs).any(), (layout, rank)
        full_blocks += int(full.sum())

        gen = torch.Generator().manual_seed(rank)
        q, k, v = torch.randn(1, 4, L, 8, generator=gen), torch.randn(1, 2, T, 8, generator=gen), \
            torch.randn(1, 2, T, 8, generator=gen)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # uncompiled flex: dense, but it applies mask_mod exactly
            flex = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
        sdpa = document_causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), plan.q_pos,
                                         plan.q_lo, kernel="sdpa")
        torch.testing.assert_close(flex, sdpa.transpose(1, 2), rtol=1e-5, atol=1e-5)
    assert full_blocks > 0 or block > 8, "no full block: the path without mask_mod is not exercised"


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")),
                    reason="torch.compile on the CPU needs a C++ compiler")
def test_compiled_flex_matches_sdpa():
    """The kernel="flex" path as it runs on CUDA (compiled flex_attention, which skips the blocks
    the BlockMask leaves out and applies no mask_mod on its full blocks), forward on the CPU
    (flex has no CPU backward): zigzag ranks of a packed batch, GQA, lengths not multiples of
    the block."""
    cu = torch.tensor([0, 3, 150, 151, 300, 333])
    for rank in range(2):
        plan = plan_from_ranges(cu, [[(0, 84), (250, 333)], [(84, 250)]], rank)
        gen = torch.Generator().manual_seed(rank)
        q = torch.randn(1, plan.q_pos.numel(), 4, 16, generator=gen)
        k, v = torch.randn(1, 333, 2, 16, generator=gen), torch.randn(1, 333, 2, 16, generator=gen)
        flex = document_causal_attention(q, k, v, plan.q_pos, plan.q_lo, kernel="flex", block_mask=plan.block_mask(16))
        sdpa = document_causal_attention(q, k, v, plan.q_pos, plan.q_lo, kernel="sdpa")
        torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_bench_attention_quick_runs_on_the_cpu(tmp_path):
    """scripts/bench_attention.py --quick as documented (CPU: tiny sizes, sdpa): every row
    measured, JSON written, and the load column shows zigzag balancing one long document."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "scripts/bench_attention.py", "--quick", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| docs | T | CP | layout |" in proc.stdout
    rows = json.loads((tmp_path / "bench_attention.json").read_text())["rows"]
    assert rows and all(r["status"] == "ok" and r["ms"] > 0 for r in rows)
    load = {(r["docs"], r["cp"], r["layout"]): r["load"] for r in rows}
    assert load[("single", 3, "zigzag")] == pytest.approx(1.0, abs=0.01)
    assert load[("single", 3, "contiguous")] > 1.5


def test_gather_index_is_a_permutation_of_the_padded_rows():
    ranges = LAYOUTS["irregular"]
    index = gather_index(ranges, rows=max(sum(e - s for s, e in r) for r in ranges))
    # rank 0 holds 33 tokens (rows 0..32), rank 1 holds 42 (rows 42..83); padded to 42 rows each
    assert sorted(index.tolist()) == list(range(33)) + list(range(42, 84))
    assert index[5].item() == 42 and index[17].item() == 5 and index[60].item() == 18 and index[30].item() == 54


def test_bad_arguments():
    with pytest.raises(ValueError, match="n_heads=4 must be a multiple of n_kv_heads=3"):
        SoftmaxAttention(D, 4, 3)
    with pytest.raises(ValueError, match="head_dim must be even for RoPE"):
        SoftmaxAttention(D, 4, head_dim=5)
    with pytest.raises(ValueError, match="rope_theta must be a positive number"):
        SoftmaxAttention(D, 4, rope_theta=-1.0)
    with pytest.raises(ValueError, match="kernel must be one of"):
        SoftmaxAttention(D, 4, kernel="ring")
    with pytest.raises(ValueError, match=r"kernel='flex' needs head dims >= 16.*\(8, 6\)"):
        SoftmaxAttention(D, 4, head_dim=8, head_v_dim=6, kernel="flex")
    # "auto" falls back to SDPA where flex's kernel cannot take the head dims
    assert resolve_kernel("auto", torch.device("cuda"), (8, 6)) == "sdpa"
    assert resolve_kernel("auto", torch.device("cuda"), (16, 64)) == "flex"
    module = _make()
    with pytest.raises(ValueError, match=r"x must be \[B, T, 32\]"):
        module(torch.randn(1, 10, D + 1))
    with pytest.raises(ValueError, match="x must be a"):
        module(torch.randn(10, D))
    with pytest.raises(ValueError, match="batch size must be 1"):
        module(torch.randn(2, 10, D), cu_seqlens=torch.tensor([0, 4, 10]))
    with pytest.raises(ValueError, match="cu_seqlens must end at T=10"):
        module(torch.randn(1, 10, D), cu_seqlens=torch.tensor([0, 4, 9]))
    # batch rows without cu_seqlens are independent sequences
    x = torch.randn(2, 10, D)
    torch.testing.assert_close(module(x)[1], module(x[1:])[0])


def test_local_plan_positions():
    plan = local_plan(torch.tensor([0, 3, 3, 7]), 7, torch.device("cpu"))
    assert plan.positions_in_doc.tolist() == [0, 1, 2, 0, 1, 2, 3]
    assert plan.pairs == 6 + 10


# ------------------------------------------------------------------------------------------
# CP: every case runs in a group of W ranks (the first W of a world of 4)

# (name, W, cu_seqlens, layout or explicit ranges, (H, Hkv, rope_theta))
CASES = [
    ("contiguous-2", 2, [0, 13, 40, 41, 64], "contiguous", (4, 2, 10000.0)),
    ("ranges-2", 2, [0, 8, 30], [[(0, 5), (17, 30)], [(5, 17)]], (4, 2, 10000.0)),
    # one document over every part; T=30 is not a multiple of 2W
    ("zigzag-2-one-doc", 2, [0, 30], "zigzag", (2, 2, None)),
    # documents crossing the fold and several parts (parts 0-9-18-27-36-45-53; rank 2 holds 18-36)
    ("zigzag-3", 3, [0, 9, 20, 44, 53], "zigzag", (4, 2, 10000.0)),
    ("contiguous-3", 3, [0, 1, 30, 53], "contiguous", (4, 1, 500.0)),
    ("zigzag-4", 4, [0, 3, 50, 61], "zigzag", (4, 2, 10000.0)),
    ("zigzag-4-one-doc", 4, [0, 61], "zigzag", (4, 4, 10000.0)),
    ("ranges-4", 4, [0, 20, 61], [[(0, 4), (40, 61)], [(4, 10)], [(10, 25)], [(25, 40)]], (4, 2, None)),
]


def _context(cu: list[int], layout, group):
    from cp_linattn.cp.context import build_cp_context

    if isinstance(layout, str):
        return build_cp_context(torch.tensor(cu), group, layout=layout)
    return build_cp_context(torch.tensor(cu), group, ranges=layout)


def _cp_rank(rank, world_size, cases):
    import torch.distributed as dist

    from cp_linattn.cp.context import shard

    groups = {W: dist.new_group(list(range(W))) if W < world_size else None for W in (2, 3)}
    groups[world_size] = None
    results = []
    for name, W, cu, layout, (H, Hkv, rope) in cases:
        if rank >= W:
            results.append(None)
            continue
        ctx = _context(cu, layout, groups[W])
        x, probe = _inputs(cu[-1])
        local = shard(x, ctx)
        assert torch.equal(local, x[:, ctx.token_positions]), name
        out, dx, grads = _run(_make(H, Hkv, rope), local, shard(probe, ctx), cp_context=ctx)
        results.append((ctx.token_positions, out, dx, grads))

    # bad calls raise on every rank, before any collective could hang
    ctx = _context([0, 61], "zigzag", None)
    x, _ = _inputs(61)
    module = _make()
    bad = x[0] if rank == 1 else shard(x, ctx)  # one rank passes a [T, D] tensor
    with pytest.raises(ValueError, match="rank 1 of 4 rejected its arguments"):
        module(bad, cp_context=ctx)
    with pytest.raises(ValueError, match="pass the local shard"):  # every rank passes the global batch
        module(x, cp_context=ctx)
    with pytest.raises(ValueError, match="cu_seqlens must be omitted under cp_context"):
        module(shard(x, ctx), cu_seqlens=ctx.cu_seqlens, cp_context=ctx)
    return results


@pytest.mark.multirank
@pytest.mark.slow
def test_cp_equals_single_rank():
    """Every layout, W = 2, 3, 4: each rank's output and input gradient equal the single-rank
    run at its tokens, and the parameter gradients summed over ranks equal the single-rank ones."""
    ranks = run_ranks(_cp_rank, 4, CASES, timeout=300)
    for i, (name, W, cu, _, (H, Hkv, rope)) in enumerate(CASES):
        x, probe = _inputs(cu[-1])
        out, dx, grads = _run(_make(H, Hkv, rope), x, probe, cu_seqlens=torch.tensor(cu))
        got_out, got_dx = torch.full_like(out, float("nan")), torch.full_like(dx, float("nan"))
        for r in range(W):
            positions, o, d, _ = ranks[r][i]
            got_out[:, positions], got_dx[:, positions] = o, d
        torch.testing.assert_close(got_out, out, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(got_dx, dx, rtol=1e-5, atol=1e-6, msg=name)
        for pname, ref in grads.items():
            total = sum(ranks[r][i][3][pname] for r in range(W))
            torch.testing.assert_close(total, ref, rtol=1e-5, atol=1e-6, msg=f"{name} {pname}")
        assert all(ranks[r][i] is None for r in range(W, 4))


@pytest.mark.gpu
def test_flex_on_cuda_as_accurate_as_sdpa():
    """The CUDA path (compiled flex_attention, bf16) for zigzag ranks of a packed batch: forward
    and q/k/v gradients within the error of bf16 SDPA, both against fp32 SDPA."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from cp_linattn.cp.context import layout_ranges

    T = 4133
    cu = torch.tensor([0, 3, 1500, 1501, 3000, T])
    ranges = layout_ranges(T, 2, "zigzag")
    for rank in range(2):
        plan = plan_from_ranges(cu, ranges, rank, device="cuda")
        gen = torch.Generator(device="cuda").manual_seed(rank)
        x = [torch.randn(1, n, h, 128, generator=gen, device="cuda") for n, h in
             ((plan.q_pos.numel(), 8), (T, 2), (T, 2))]
        do = torch.randn(1, plan.q_pos.numel(), 8, 128, generator=gen, device="cuda")

        def run(kernel, dtype, **kw):
            leaves = [t.detach().to(dtype).requires_grad_() for t in x]
            o = document_causal_attention(*leaves, plan.q_pos, plan.q_lo, kernel=kernel, **kw)
            o.backward(do.to(dtype))
            return [o.float()] + [t.grad.float() for t in leaves]

        truth = run("sdpa", torch.float32)
        flex = run("flex", torch.bfloat16, block_mask=plan.block_mask())
        sdpa = run("sdpa", torch.bfloat16)
        for name, f, s, t in zip(("o", "dq", "dk", "dv"), flex, sdpa, truth):
            err_flex = ((f - t).norm() / t.norm()).item()
            err_sdpa = ((s - t).norm() / t.norm()).item()
            assert err_flex <= max(1e-2, 1.5 * err_sdpa), (rank, name, err_flex, err_sdpa)


def _gpu_cp_rank(rank, world_size, cu, layout):
    from cp_linattn.cp.context import build_cp_context, shard

    ctx = build_cp_context(torch.tensor(cu, device="cuda"), layout=layout)
    x, probe = (t.cuda() for t in _inputs(cu[-1]))
    module = _make().cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, dx, grads = _run(module, shard(x, ctx), shard(probe, ctx), cp_context=ctx)
    return ctx.token_positions, out.float().cpu(), dx.float().cpu(), {n: g.cpu() for n, g in grads.items()}


@pytest.mark.gpu
@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_cp_on_one_gpu_bf16(layout):
    """Three gloo processes sharing the GPU: CUDA K/V cross ranks through the CPU; the flex
    path under bf16 autocast equals the single-rank bf16 run up to bf16 rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cu = [0, 700, 701, 2900, 3001]
    ranks = run_ranks(_gpu_cp_rank, 3, cu, layout, timeout=300)
    x, probe = (t.cuda() for t in _inputs(cu[-1]))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, dx, grads = _run(_make().cuda(), x, probe, cu_seqlens=torch.tensor(cu, device="cuda"))
    got_out, got_dx = torch.zeros_like(out.float().cpu()), torch.zeros_like(dx.float().cpu())
    for positions, o, d, _ in ranks:
        got_out[:, positions], got_dx[:, positions] = o, d
    for name, got, ref in [("out", got_out, out), ("dx", got_dx, dx)] + [
            (n, sum(r[3][n] for r in ranks), g) for n, g in grads.items()]:
        ref = ref.float().cpu()
        assert ((got - ref).norm() / ref.norm()).item() < 2e-2, name
