"""Training entry point: data, CP/DP equivalence, resume, check_cp, config errors."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from launch.data import IGNORE, MQAR, ByteText
from launch.config import ConfigError
from launch.train import load_config
from tests.multirank import run_ranks, torchrun

REPO = Path(__file__).resolve().parents[2]
TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=1", "model.head_k_dim=16", "model.head_v_dim=16",
        "data.tokens_per_batch=96", "trainer.log_every=1", "optim.warmup_steps=2"]


def test_mqar_batches():
    data = MQAR(tokens_per_batch=200, num_keys=16, num_values=16, min_pairs=2, max_pairs=8, vocab_size=33, seed=0)
    b = data.batch(dp_rank=0, step=3)
    assert b.input_ids.shape == b.labels.shape == (1, 200)
    assert int(b.cu_seqlens[-1]) == 200 and len(set(torch.diff(b.cu_seqlens).tolist())) > 1
    assert torch.equal(b.input_ids, data.batch(0, 3).input_ids)
    assert not torch.equal(b.input_ids, data.batch(1, 3).input_ids)
    for s, e in zip(b.cu_seqlens[:-2].tolist(), b.cu_seqlens[1:-1].tolist()):  # the last one may be cut
        ids, labels = b.input_ids[0, s:e], b.labels[0, s:e]
        n = (e - s) // 4
        pairs = dict(zip(ids[:2 * n:2].tolist(), ids[1:2 * n:2].tolist()))
        answered = labels != IGNORE
        assert int(answered.sum()) == n and not answered[:2 * n].any()
        # every answer is the value stored under the queried key, and the next token
        for t in torch.nonzero(answered).flatten().tolist():
            assert labels[t] == pairs[int(ids[t])] == ids[t + 1]


def test_text_batches(tmp_path):
    (tmp_path / "a.txt").write_text("hello world, " * 20)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("the quick brown fox " * 20)
    data = ByteText(str(tmp_path), tokens_per_batch=100, min_doc_len=8, max_doc_len=30, vocab_size=256, seed=1)
    b = data.batch(0, 0)
    last = b.cu_seqlens[1:] - 1
    assert (b.labels[0, last[:-1]] == IGNORE).all()
    inner = torch.ones(100, dtype=torch.bool)
    inner[last] = False
    assert torch.equal(b.labels[0, :-1][inner[:-1]], b.input_ids[0, 1:][inner[:-1]])
    with pytest.raises(ValueError, match="data.path"):
        ByteText(str(tmp_path / "missing"), 100, 8, 30, 256, 0)


def test_bad_configs():
    """Checked when composed (load_config), before anything runs; more in test_app.py."""
    with pytest.raises(Exception, match="model/mamba"):
        load_config(["model=mamba"])
    with pytest.raises(ConfigError, match="model.type must be one of"):
        load_config(["model.type=mamba"])


def _setup_rank(rank, world_size, overrides):
    from launch.train import setup

    setup(load_config(overrides))


@pytest.mark.multirank
@pytest.mark.slow
def test_cp_degree_must_divide_world():
    with pytest.raises(pytest.fail.Exception, match="cp.degree must be a positive int dividing the world size 2"):
        run_ranks(_setup_rank, 2, ["cp.degree=3"], timeout=60)


def _train_rank(rank, world_size, overrides):
    from launch.train import train

    return train(load_config(overrides))


def _losses(records):
    return [r["loss"] for r in records]


@pytest.mark.interpreter
@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("model", ["gla", "kda"])
def test_cp2_training_matches_cp1_and_resumes_exactly(tmp_path, model):
    common = TINY + [f"model={model}", "trainer.steps=4", "trainer.ckpt_every=2"]
    cp1 = run_ranks(_train_rank, 1, common + ["cp.degree=1", f"run_dir={tmp_path / 'cp1'}"], timeout=600)[0]
    full = tmp_path / "cp2"
    cp2 = run_ranks(_train_rank, 2, common + ["cp.degree=2", f"run_dir={full}"], timeout=600)
    assert _losses(cp2[0]) == _losses(cp2[1])
    torch.testing.assert_close(_losses(cp2[0]), _losses(cp1), rtol=1e-4, atol=0)
    assert _losses(cp1)[-1] < _losses(cp1)[0]
    assert (full / "loss.png").stat().st_size > 0

    # interrupted after step 2: only its checkpoint survives, and a stale record of step 3
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000004")
    lines = (resumed / "metrics.jsonl").read_text().splitlines()
    (resumed / "metrics.jsonl").write_text("\n".join(lines[:3]) + "\n")
    again = run_ranks(_train_rank, 2, common + ["cp.degree=2", f"run_dir={resumed}"], timeout=600)[0]
    assert [r["step"] for r in again] == [3, 4]
    assert _losses(again) == _losses(cp2[0])[2:]
    records = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert _losses(records) == _losses(cp2[0])


def _grads_rank(rank, world_size, overrides, dp_batches):
    """Gradients of step 0 after the world all-reduce; with dp_batches, one rank sums the
    gradients of that many DP batches itself (the reference)."""
    from launch.train import (IGNORE, all_reduce_gradients, build_data, forward_backward, local_batch, make_model,
                              setup)
    from omegaconf import OmegaConf

    cfg = load_config(overrides)
    env = setup(cfg)
    data = build_data(OmegaConf.to_container(cfg.data, resolve=True), cfg.seed)
    model = make_model(cfg, env)
    ranks = range(dp_batches) if dp_batches else [env.dp_rank]
    parts = [local_batch(data.batch(r, 0), env, cfg.cp.comm) for r in ranks]
    num_targets = torch.tensor(float(sum(int((labels != IGNORE).sum()) for _, labels, _, _ in parts)))
    if not dp_batches:
        torch.distributed.all_reduce(num_targets)
    for input_ids, labels, cu_seqlens, ctx in parts:
        forward_backward(model, env, input_ids, labels, cu_seqlens, ctx, int(num_targets))
    if not dp_batches:
        all_reduce_gradients(model)
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.interpreter
@pytest.mark.multirank
@pytest.mark.slow
def test_dp_cp_mesh_gradients_equal_single_rank():
    overrides = TINY + ["model=kda"]
    ref = run_ranks(_grads_rank, 1, overrides + ["cp.degree=1"], 2, timeout=300)[0]
    mesh = run_ranks(_grads_rank, 4, overrides + ["cp.degree=2"], 0, timeout=600)
    for name, g in ref.items():
        for r in range(4):
            torch.testing.assert_close(mesh[r][name], g, rtol=1e-4, atol=1e-6, msg=f"rank {r} {name}")


@pytest.mark.interpreter
@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("nproc,model", [(2, "gla"), (4, "gla"), (2, "kda"), (4, "kda")])
def test_check_cp_torchrun(nproc, model):
    out = torchrun("launch.check_cp", nproc, *TINY, f"model={model}")
    assert f"CP over {nproc} ranks vs no CP" in out and ": OK" in out
    assert "grad.blocks.0.attn.q_proj.weight" in out
