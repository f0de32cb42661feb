"""model.ops: ours | fla, validated before a run writes anything: the choices, fla only with
cp.degree=1, and FLA 0.6.0 installed (a stand-in for it: tests/layers/fla_stub.py); a resume
may switch it."""
import json
import sys

import pytest
from omegaconf import OmegaConf

from launch.config import RESUME_MAY_CHANGE, ConfigError, load_config, resume_mismatches
from launch.train import main as train_main
from tests.layers.fla_stub import install_fake_fla

MODELS = [["model=kda"], ["model=gla"], ["model=hybrid"], ["model=hybrid", "model.linear=gla"]]


def test_default_is_ours():
    for model in MODELS:
        assert load_config(model).model.ops == "ours"


def test_bad_value_names_the_key_and_the_choices(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"^model.ops must be one of \['ours', 'fla'\], got 'triton'$"):
        load_config(["model.ops=triton"])
    assert train_main(["model.ops=triton", f"run_dir={tmp_path / 'run'}"]) == 2
    out = capsys.readouterr()
    assert out.err == "error: model.ops must be one of ['ours', 'fla'], got 'triton'\n" and out.out == ""
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("model", MODELS)
def test_fla_needs_cp_degree_1(model, monkeypatch, tmp_path, capsys):
    install_fake_fla(monkeypatch)  # installed or not: CP is refused first
    message = ("model.ops=fla needs cp.degree=1 (FLA's kernels do not take our CP context), got cp.degree=2")
    with pytest.raises(ConfigError) as e:
        load_config([*model, "model.ops=fla", "cp.degree=2"])
    assert str(e.value) == message
    assert train_main([*model, "model.ops=fla", "cp.degree=2", f"run_dir={tmp_path / 'run'}"]) == 2
    out = capsys.readouterr()
    assert out.err == f"error: {message}\n" and out.out == ""
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("model", MODELS)
def test_fla_missing_says_how_to_install(model, monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "fla", None)  # as if not installed, even where it is
    with pytest.raises(ConfigError, match=r"^model.ops=fla: FLA 0\.6\.0 must be installed: "
                                          r"pip install flash-linear-attention==0\.6\.0 \("):
        load_config([*model, "model.ops=fla", "cp.degree=1"])
    assert train_main([*model, "model.ops=fla", "cp.degree=1", f"run_dir={tmp_path / 'run'}"]) == 2
    out = capsys.readouterr()
    assert out.err.startswith("error: model.ops=fla: FLA 0.6.0 must be installed: pip install "
                              "flash-linear-attention==0.6.0") and out.err.count("\n") == 1 and out.out == ""
    assert not (tmp_path / "run").exists()
    install_fake_fla(monkeypatch, version="0.7.0")
    with pytest.raises(ConfigError, match=r"FLA 0\.6\.0 must be installed.*\(found fla 0\.7\.0\)$"):
        load_config([*model, "model.ops=fla", "cp.degree=1"])


@pytest.mark.parametrize("model", MODELS)
def test_fla_with_cp_degree_1_is_accepted(model, monkeypatch):
    install_fake_fla(monkeypatch)
    assert load_config([*model, "model.ops=fla", "cp.degree=1"]).model.ops == "fla"


def test_resume_may_switch_ops(monkeypatch):
    """Same parameters, same math: a run may resume with the other ops (checkpoints without a
    model.ops entry too)."""
    install_fake_fla(monkeypatch)
    assert "model.ops" in RESUME_MAY_CHANGE
    saved = OmegaConf.to_container(load_config(["cp.degree=1"]), resolve=True)
    fla = load_config(["cp.degree=1", "model.ops=fla"])
    assert resume_mismatches(saved, fla, saved_dp=1, dp=1) == []
    del saved["model"]["ops"]
    assert resume_mismatches(saved, fla, saved_dp=1, dp=1) == []
    assert resume_mismatches(saved, load_config(["cp.degree=1", "model.d_model=32"]), saved_dp=1, dp=1) == [
        "model.d_model: 64 -> 32"]


@pytest.mark.interpreter
def test_train_with_fla_then_resume_with_ours(monkeypatch, tmp_path, capsys):
    """launch.train in this process (a world of one) with model.ops=fla: every step calls
    FLA's op (the stand-in); the run then resumes with model.ops=ours."""
    calls = install_fake_fla(monkeypatch)
    tiny = ["model=gla", "model.d_model=32", "model.n_layers=1", "model.n_heads=1", "model.head_k_dim=16",
            "model.head_v_dim=16", "data.tokens_per_batch=96", "optim.warmup_steps=1", "cp.degree=1",
            "trainer.ckpt_every=1", "trainer.log_every=1", f"run_dir={tmp_path / 'run'}"]
    assert train_main([*tiny, "model.ops=fla", "trainer.steps=2"]) == 0, capsys.readouterr().err
    assert [name for name, _, _ in calls] == ["chunk_gla"] * 2
    assert train_main([*tiny, "model.ops=ours", "trainer.steps=3"]) == 0, capsys.readouterr().err
    assert "resuming from" in capsys.readouterr().out and len(calls) == 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and all(r["tokens_per_s"] > 0 for r in records)
