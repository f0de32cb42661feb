"""The hybrid model (linear blocks with a softmax-attention block every `attn_every`): its
layer pattern and config errors, and CP in the zigzag layout equal to the single-rank run."""
import pytest
import torch

from cp_linattn.layers import GatedLinearAttention, KimiDeltaAttention, SoftmaxAttention
from cp_linattn.models import LMConfig, build_model
from tests.multirank import run_ranks

VOCAB = 40


def _config(linear: str = "kda", **kw) -> LMConfig:
    fields = dict(type="hybrid", linear=linear, vocab_size=VOCAB, d_model=32, n_layers=2, attn_every=2, n_heads=2,
                  n_kv_heads=1, head_k_dim=16, head_v_dim=16)
    return LMConfig(**{**fields, **kw})


def test_layer_pattern():
    model = build_model(_config("kda", n_layers=8, attn_every=4))
    kinds = [type(block.attn) for block in model.blocks]
    assert kinds == [KimiDeltaAttention] * 3 + [SoftmaxAttention] + [KimiDeltaAttention] * 3 + [SoftmaxAttention]
    attn = model.blocks[3].attn
    assert (attn.n_heads, attn.n_kv_heads, attn.head_dim, attn.rope_theta) == (2, 1, 16, 10000.0)
    assert _config("gla", n_layers=3, attn_every=1, rope_theta=None).mixers == ["softmax"] * 3
    assert build_model(_config("gla", rope_theta=None)).blocks[1].attn.rope_theta is None
    assert isinstance(build_model(_config("gla")).blocks[0].attn, GatedLinearAttention)
    # the other types ignore the hybrid fields
    assert LMConfig(type="gla", n_layers=3, attn_every=1).mixers == ["gla"] * 3


@pytest.mark.parametrize("field,value,match", [
    ("linear", "mamba", "model.linear must be one of"),
    ("attn_every", 3, "model.attn_every=3 exceeds model.n_layers=2"),
    ("attn_every", 0, "model.attn_every must be a positive int"),
    ("n_kv_heads", 3, "model.n_kv_heads=3 must divide model.n_heads=2"),
    ("rope_theta", 0.0, "model.rope_theta must be a positive number or null"),
])
def test_bad_config(field, value, match):
    with pytest.raises(ValueError, match=match):
        _config(**{field: value})


def _inputs(T: int):
    gen = torch.Generator().manual_seed(T)
    return torch.randint(0, VOCAB, (1, T), generator=gen), torch.randn(1, T, VOCAB, generator=gen)


def _run(model, ids, probe, **kw):
    """Forward, backward of sum(logits * probe): (logits, {param: grad})."""
    logits = model(ids, **kw)
    (logits * probe).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _model(linear: str):
    torch.manual_seed(0)
    return build_model(_config(linear))


# (W, linear, cu_seqlens): zigzag; a document crossing the fold, a short one, one over every part
CASES = [(2, "gla", [0, 11, 14, 45]), (3, "kda", [0, 5, 40, 52])]


def _cp_rank(rank, world_size, cases):
    import torch.distributed as dist

    from cp_linattn.cp.context import build_cp_context, shard

    pair = dist.new_group([0, 1])
    results = []
    for W, linear, cu in cases:
        if rank >= W:
            results.append(None)
            continue
        ctx = build_cp_context(torch.tensor(cu), pair if W == 2 else None, conv1d_kernel_size=4, layout="zigzag")
        ids, probe = _inputs(cu[-1])
        logits, grads = _run(_model(linear), shard(ids, ctx), shard(probe, ctx), cp_context=ctx)
        results.append((ctx.token_positions, logits, grads))
    return results


@pytest.mark.interpreter
@pytest.mark.multirank
@pytest.mark.slow
def test_zigzag_cp_equals_single_rank():
    ranks = run_ranks(_cp_rank, 3, CASES, timeout=600)
    for i, (W, linear, cu) in enumerate(CASES):
        ids, probe = _inputs(cu[-1])
        ref, grads = _run(_model(linear), ids, probe, cu_seqlens=torch.tensor(cu))
        got = torch.full_like(ref, float("nan"))
        for r in range(W):
            got[:, ranks[r][i][0]] = ranks[r][i][1]
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5, msg=f"W={W} {linear}")
        for name, g in grads.items():
            total = sum(ranks[r][i][2][name] for r in range(W))
            torch.testing.assert_close(total, g, rtol=1e-4, atol=1e-5, msg=f"W={W} {linear} {name}")
