"""ops="fla": the GLA/KDA layers call FLA 0.6.0's op (here a recording stand-in,
tests/layers/fla_stub.py) with exactly the arguments they give ours; the model swaps every
linear layer's op (softmax attention stays ours); a missing FLA or a CP context is refused."""
import sys

import pytest
import torch

import cp_linattn.layers.gla as gla_layer
import cp_linattn.layers.kda as kda_layer
from cp_linattn.layers import GatedLinearAttention, KimiDeltaAttention, SoftmaxAttention
from cp_linattn.models import LMConfig, build_model
from tests.layers.fla_stub import install_fake_fla

D, H, K = 32, 2, 16
LAYERS = {"kda": (KimiDeltaAttention, kda_layer, "chunk_kda"), "gla": (GatedLinearAttention, gla_layer, "chunk_gla")}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["gla", "kda"])
def test_fla_layer_calls_flas_op_with_our_arguments(kind, monkeypatch):
    layer_cls, module, name = LAYERS[kind]
    fla_calls = install_fake_fla(monkeypatch)
    our_calls = []
    ours_op = getattr(module, name)

    def recording(*args, **kwargs):
        our_calls.append((name, args, kwargs))
        return ours_op(*args, **kwargs)

    monkeypatch.setattr(module, name, recording)  # what load_chunk_*("ours") hands the layer
    torch.manual_seed(0)
    ours = layer_cls(D, H, K, K)
    fla = layer_cls(D, H, K, K, ops="fla")
    fla.load_state_dict(ours.state_dict())
    assert (ours.ops, fla.ops) == ("ours", "fla") and getattr(fla, name) is sys.modules[f"fla.ops.{kind}"].__dict__[name]

    cu = torch.tensor([0, 13, 24])
    x = torch.randn(1, 24, D)
    probe = torch.randn(1, 24, D)
    results = []
    for layer in (ours, fla):
        xi = x.clone().requires_grad_()
        out = layer(xi, cu_seqlens=cu)
        (out * probe).sum().backward()
        results.append((out.detach(), xi.grad, {n: p.grad for n, p in layer.named_parameters()}))

    assert len(our_calls) == len(fla_calls) == 1
    (_, our_args, our_kw), (fla_name, fla_args, fla_kw) = our_calls[0], fla_calls[0]
    assert fla_name == name and len(our_args) == len(fla_args) and our_kw.keys() == fla_kw.keys()
    assert all(_same(a, b) for a, b in zip(our_args, fla_args))
    assert all(_same(our_kw[k], fla_kw[k]) for k in our_kw), sorted(k for k in our_kw if not _same(our_kw[k], fla_kw[k]))
    assert "cp_context" not in fla_kw or fla_kw["cp_context"] is None  # FLA never sees our context
    # the same op result, so the same output and gradients
    (o1, dx1, g1), (o2, dx2, g2) = results
    assert torch.equal(o1, o2) and torch.equal(dx1, dx2) and all(torch.equal(g1[n], g2[n]) for n in g1)


@pytest.mark.parametrize("kind", ["gla", "kda"])
def test_fla_layer_refuses_a_cp_context(kind, monkeypatch):
    install_fake_fla(monkeypatch)
    layer = LAYERS[kind][0](D, H, K, K, ops="fla")
    with pytest.raises(ValueError, match=r"ops='fla'\) does not take a cp_context"):
        layer(torch.randn(1, 8, D), cp_context=object())


@pytest.mark.parametrize("kind", ["gla", "kda"])
def test_fla_missing_or_another_version(kind, monkeypatch):
    layer_cls = LAYERS[kind][0]
    monkeypatch.setitem(sys.modules, "fla", None)  # `import fla` raises ImportError
    with pytest.raises(ImportError, match=r"FLA 0\.6\.0 must be installed: pip install flash-linear-attention==0\.6\.0"):
        layer_cls(D, H, K, K, ops="fla")
    install_fake_fla(monkeypatch, version="0.5.0")
    with pytest.raises(ImportError, match=r"FLA 0\.6\.0 must be installed.*\(found fla 0\.5\.0\)"):
        layer_cls(D, H, K, K, ops="fla")
    with pytest.raises(ValueError, match=r"ops must be one of \['ours', 'fla'\], got 'triton'"):
        layer_cls(D, H, K, K, ops="triton")
    layer_cls(D, H, K, K)  # ours needs no FLA


@pytest.mark.parametrize("linear", ["kda", "gla"])
def test_model_swaps_every_linear_layer(linear, monkeypatch):
    install_fake_fla(monkeypatch)
    fake = getattr(sys.modules[f"fla.ops.{linear}"], f"chunk_{linear}")
    fields = dict(vocab_size=40, d_model=D, n_layers=4, n_heads=H, head_k_dim=K, head_v_dim=K)
    for cfg in (LMConfig(type=linear, **fields), LMConfig(type="hybrid", linear=linear, attn_every=2, **fields)):
        for ops in ("ours", "fla"):
            model = build_model({**cfg.__dict__, "ops": ops})
            mixers = [block.attn for block in model.blocks]
            linear_layers = [m for m in mixers if not isinstance(m, SoftmaxAttention)]
            assert len(linear_layers) == cfg.mixers.count(linear) and len(mixers) == cfg.n_layers
            assert all(m.ops == ops and (getattr(m, f"chunk_{linear}") is fake) == (ops == "fla")
                       for m in linear_layers)
    with pytest.raises(ValueError, match=r"model.ops must be one of \['ours', 'fla'\], got 'FLA'"):
        LMConfig(ops="FLA")
