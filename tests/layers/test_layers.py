"""Layers and the model: varlen independence, CP over 2-4 ranks equal to the unsharded run."""
import pytest
import torch

from cp_linattn.layers import GatedLinearAttention, KimiDeltaAttention
from cp_linattn.models import LMConfig, build_model
from tests.multirank import run_ranks

D, H, K = 32, 2, 16
VOCAB = 50


def _make(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gla":
        return GatedLinearAttention(D, H, K, K)
    if kind == "kda":
        return KimiDeltaAttention(D, H, K, K)
    return build_model(LMConfig(type=kind.split("-")[1], vocab_size=VOCAB, d_model=D, n_layers=2, n_heads=H,
                                head_k_dim=K, head_v_dim=K, tie_embeddings=kind.endswith("tied")))


def _inputs(kind: str, T: int):
    gen = torch.Generator().manual_seed(T)
    if kind.startswith("lm"):
        x = torch.randint(0, VOCAB, (1, T), generator=gen)
        probe = torch.randn(1, T, VOCAB, generator=gen)
    else:
        x = torch.randn(1, T, D, generator=gen)
        probe = torch.randn(1, T, D, generator=gen)
    return x, probe


def _run(module, x, probe, **kw):
    """Forward, backward of `sum(out * probe)`; (out, dx or None, {param: grad})."""
    if x.is_floating_point():
        x = x.clone().requires_grad_()
    out = module(x, **kw)
    (out * probe).sum().backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    return out.detach(), x.grad, grads


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["gla", pytest.param("kda", marks=pytest.mark.slow)])
def test_packed_sequences_are_independent(kind):
    cu = [0, 70, 75, 150]
    module = _make(kind)
    x, probe = _inputs(kind, cu[-1])
    packed = module(x, cu_seqlens=torch.tensor(cu))
    for s, e in zip(cu[:-1], cu[1:]):
        alone = module(x[:, s:e], cu_seqlens=torch.tensor([0, e - s]))
        torch.testing.assert_close(packed[:, s:e], alone, rtol=1e-4, atol=1e-5)


def test_bad_model_config():
    with pytest.raises(ValueError, match="model.type"):
        LMConfig(type="mamba")
    with pytest.raises(ValueError, match="unknown model config keys"):
        build_model({"type": "gla", "d_modle": 32})


KINDS = ["gla", "kda", "lm-gla-tied", "lm-kda"]


def _cp_rank(rank, world_size, cases):
    from cp_linattn.cp.context import build_cp_context, shard

    ctx = build_cp_context(torch.tensor(cases[0][1]))
    x, _ = _inputs("gla", cases[0][1][-1])
    # local offsets where the global ones (or None) are due
    with pytest.raises(ValueError, match="cu_seqlens must be omitted under cp_context"):
        _make("gla")(shard(x, ctx), cu_seqlens=ctx.cu_seqlens, cp_context=ctx)
    # the global batch with a context: the mistake of a wrapper that forgot to shard
    with pytest.raises(ValueError, match="pass the local shard"):
        _make("kda")(x, cp_context=ctx)
    results = []
    for kind, cu_list in cases:
        ctx = build_cp_context(torch.tensor(cu_list), conv1d_kernel_size=4)
        x, probe = _inputs(kind, cu_list[-1])
        results.append(_run(_make(kind), shard(x, ctx), shard(probe, ctx), cp_context=ctx))
    return results


# sequences spanning several ranks, a rank inside one sequence, a short tail sequence
CU = {2: [0, 100, 103, 190], 3: [0, 30, 190], 4: [0, 40, 41, 170, 190]}


@pytest.mark.interpreter
@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("world_size", sorted(CU))
def test_cp_equals_unsharded(world_size):
    cases = [(kind, CU[world_size]) for kind in KINDS]
    ranks = run_ranks(_cp_rank, world_size, cases, timeout=600)
    for i, (kind, cu_list) in enumerate(cases):
        x, probe = _inputs(kind, cu_list[-1])
        out, dx, grads = _run(_make(kind), x, probe, cu_seqlens=torch.tensor(cu_list))
        got = [r[i] for r in ranks]
        torch.testing.assert_close(torch.cat([g[0] for g in got], 1), out, rtol=1e-4, atol=1e-4, msg=kind)
        if dx is not None:
            torch.testing.assert_close(torch.cat([g[1] for g in got], 1), dx, rtol=1e-4, atol=1e-4, msg=kind)
        for name, ref in grads.items():
            total = sum(g[2][name] for g in got)
            torch.testing.assert_close(total, ref, rtol=1e-4, atol=1e-4, msg=f"{kind} {name}")
