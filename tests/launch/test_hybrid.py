"""The hybrid model through the entry points in the zigzag layout: check_cp under torchrun at
N=2 and N=4, training with CP equal to training without it, resuming exactly; cp.layout errors."""
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from cp_linattn.models import LMConfig
from launch.train import load_config, setup
from tests.multirank import run_ranks, torchrun

REPO = Path(__file__).resolve().parents[2]
# two blocks: a linear one, then softmax attention with 2 query heads sharing 1 key/value head
TINY = ["model=hybrid", "model.d_model=32", "model.n_layers=2", "model.attn_every=2", "model.n_heads=2",
        "model.n_kv_heads=1", "model.head_k_dim=16", "model.head_v_dim=16", "data.tokens_per_batch=96",
        "trainer.log_every=1", "optim.warmup_steps=2", "cp.layout=zigzag"]


def test_bad_layout():
    with pytest.raises(ValueError, match=r"cp.layout must be one of \['contiguous', 'zigzag'\], got 'ring'"):
        setup(load_config(["cp.layout=ring"]))


def test_hybrid_config():
    cfg = load_config(["model=hybrid"])
    assert cfg.cp.layout == "contiguous"
    assert LMConfig(**OmegaConf.to_container(cfg.model, resolve=True)).mixers == ["kda", "kda", "kda", "softmax"]


@pytest.mark.interpreter
@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("nproc,linear", [(2, "kda"), (4, "gla")])
def test_check_cp_torchrun(nproc, linear):
    out = torchrun("launch.check_cp", nproc, *TINY, f"model.linear={linear}")
    assert f"CP over {nproc} ranks vs no CP (zigzag layout)" in out and ": OK" in out
    assert "grad.blocks.1.attn.k_proj.weight" in out  # the softmax block's


def _train_rank(rank, world_size, overrides):
    """The records of launch.train, and the token ranges of every rank in its first batch."""
    from launch.train import build_data, local_batch, train

    cfg = load_config(overrides)
    records = train(cfg)
    env = setup(cfg)
    batch = build_data(OmegaConf.to_container(cfg.data, resolve=True), cfg.seed).batch(env.dp_rank, 0)
    ctx = local_batch(batch, env, cfg.cp.comm)[3]
    return records, None if ctx is None else ctx.all_ranges


def _losses(records):
    return [r["loss"] for r in records]


@pytest.mark.interpreter
@pytest.mark.multirank
@pytest.mark.slow
def test_zigzag_training_matches_cp1_and_resumes_exactly(tmp_path):
    common = TINY + ["model.linear=gla", "trainer.steps=4", "trainer.ckpt_every=2"]
    cp1 = run_ranks(_train_rank, 1, common + ["cp.degree=1", f"run_dir={tmp_path / 'cp1'}"], timeout=600)[0][0]
    full = tmp_path / "cp2"
    cp2, ranges = zip(*run_ranks(_train_rank, 2, common + ["cp.degree=2", f"run_dir={full}"], timeout=600))
    assert ranges[0] == (((0, 24), (72, 96)), ((24, 72),))  # zigzag: rank 1's two parts merge
    assert _losses(cp2[0]) == _losses(cp2[1])
    torch.testing.assert_close(_losses(cp2[0]), _losses(cp1), rtol=1e-4, atol=0)
    assert _losses(cp1)[-1] < _losses(cp1)[0]

    # interrupted after step 2: only its checkpoint survives
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000004")
    again = run_ranks(_train_rank, 2, common + ["cp.degree=2", f"run_dir={resumed}"], timeout=600)[0][0]
    assert [r["step"] for r in again] == [3, 4]
    assert _losses(again) == _losses(cp2[0])[2:]
