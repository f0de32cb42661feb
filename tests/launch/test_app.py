"""launch.train and launch.check_cp as hydra apps: --help, --cfg job, -m sweeps, one plain
process or torchrun; the typed config and its validation; config errors as one line."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from launch.check_cp import main as check_cp_main
from launch.cli import error_message
from launch.config import ConfigError, load_config, resume_mismatches
from launch.train import main as train_main
from tests.multirank import torchrun

REPO = Path(__file__).resolve().parents[2]
TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=1", "model.head_k_dim=16", "model.head_v_dim=16",
        "data.tokens_per_batch=96", "trainer.log_every=1", "optim.warmup_steps=1"]


def cli(module: str, *args: str, cwd: Path, nproc: int = 0) -> subprocess.CompletedProcess:
    """`python -m module args` (or under torchrun with nproc ranks) in `cwd`, which it may write."""
    launcher = ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}"] if nproc else []
    return subprocess.run([sys.executable, *launcher, "-m", module, *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)


def test_help_lists_groups_and_options(tmp_path):
    out = cli("launch.train", "--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "data: mqar, text" in out.stdout and "model: gla, hybrid, kda" in out.stdout
    assert "torchrun --nproc_per_node=2 -m launch.train" in out.stdout and "-m cp.degree=1,2" in out.stdout
    assert "cp:\n  degree: 2\n  comm: all_gather" in out.stdout  # the composed config
    assert list(tmp_path.iterdir()) == []  # wrote nothing


def test_check_cp_help_and_one_rank(tmp_path, capsys):
    out = cli("launch.check_cp", "--help", cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("launch.check_cp:"), out.stderr
    # one rank: nothing to compare, an error rather than a vacuous OK
    assert check_cp_main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: launch.check_cp compares CP over all ranks with no CP, and with 1 rank") \
        and err.count("\n") == 1


def test_cfg_job_prints_the_composed_config(tmp_path):
    out = cli("launch.train", "--cfg", "job", "model=gla", "cp.degree=4", "optim.lr=1e-2", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    assert cfg["model"]["type"] == "gla" and cfg["cp"]["degree"] == 4 and cfg["optim"]["lr"] == 0.01
    assert cfg["data"]["name"] == "mqar" and cfg["trainer"]["resume"] is True
    assert list(tmp_path.iterdir()) == []


def test_config_types_and_values_are_checked():
    cfg = load_config(["model=hybrid", "optim.lr=1"])
    assert isinstance(cfg.optim.lr, float) and cfg.model.n_kv_heads == 1 and cfg.cp.layout == "contiguous"
    bad = {  # override: what the error must say
        "cp.comm=bogus": "cp.comm must be one of ['all_gather', 'send_recv'], got 'bogus'",
        "cp.degree=0": "cp.degree must be >= 1",
        "precision=fp16": "precision must be one of",
        "optim.min_lr=1": "optim.min_lr must be in [0, optim.lr=",
        "optim.betas=[0.9]": "optim.betas must be two numbers",
        "trainer.steps=0": "trainer.steps must be >= 1",
        "trainer.ckpt_every=-1": "trainer.ckpt_every must be >= 0",
        "data=text": "data.path is required with data=text",
        "data.min_pairs=5": "data.min_pairs=5, data.max_pairs=4, data.num_keys=8: need 1 <= min_pairs",
        "model.vocab_size=10": "model.vocab_size=10 must be >= data.vocab_size=",
        "model.type=mamba": "model.type must be one of ['gla', 'kda', 'hybrid'], got 'mamba'",
    }
    for override, message in bad.items():
        with pytest.raises(ConfigError) as e:
            load_config([override])
        assert message in str(e.value), (override, str(e.value))


@pytest.mark.parametrize("override,message", [
    ("cp.degree=x", "error: cp.degree: Value 'x' of type 'str' could not be converted to Integer"),
    ("data.foo=1", "error: data.foo: Key 'foo' not in 'MQARConfig'"),
    ("model=mamba", "error: In 'train': Could not find 'model/mamba'. Available options in 'model': gla, hybrid, kda"),
    ("cp.comm=bogus", "error: cp.comm must be one of ['all_gather', 'send_recv'], got 'bogus'"),
    ("data=text", "error: data.path is required with data=text: pass data.path=<a text file or a folder>"),
    ("cp.degree=2", "error: cp.degree must be a positive int dividing the world size 1, got 2 (one process: pass "
                    "cp.degree=1, or run under torchrun --nproc_per_node=N)"),
])
def test_config_error_is_one_line(override, message, tmp_path, capsys):
    """In process (hydra's parse, compose and the job's own checks): one line, status 2."""
    assert train_main([override, f"run_dir={tmp_path / 'run'}"]) == 2
    out = capsys.readouterr()
    assert out.err == message + "\n" and out.out == ""
    assert not (tmp_path / "run").exists()


def test_error_message_of_a_bug_is_not_hidden():
    """Only config errors are shortened; error_message is not used on anything else, but its
    fallback keeps every line's text."""
    assert error_message(RuntimeError("a\n\tb\n\tc\nd")) == "a b, c. d"


@pytest.mark.multirank
def test_config_error_under_torchrun_prints_once(tmp_path):
    out = cli("launch.train", "data=text", cwd=tmp_path, nproc=2)
    assert out.returncode != 0
    both = out.stdout + out.stderr
    assert both.count("error: data.path is required with data=text") == 1, both
    assert "launch/" not in both  # no rank's traceback (torchrun reports the failed child itself)
    assert list(tmp_path.iterdir()) == []


def test_resume_mismatches():
    """What a resume may change (RESUME_MAY_CHANGE) passes; anything else, and another
    data-parallel degree, is named with its old and new values."""
    saved = OmegaConf.to_container(load_config(), resolve=True)
    allowed = load_config(["trainer.steps=60", "trainer.log_every=1", "trainer.ckpt_every=0", "trainer.resume=false",
                           "cp.degree=1", "cp.comm=send_recv", "cp.layout=zigzag", "backend=gloo", "run_dir=elsewhere",
                           "check.tol=0.1"])
    assert resume_mismatches(saved, allowed, saved_dp=1, dp=1) == []
    changed = load_config(["model=gla", "optim.lr=0.5"])
    assert resume_mismatches(saved, changed, saved_dp=1, dp=2) == [
        "model.type: 'kda' -> 'gla'", f"optim.lr: {saved['optim']['lr']!r} -> 0.5",
        "data-parallel degree (world size / cp.degree): 1 -> 2"]


@pytest.mark.interpreter
@pytest.mark.multirank
@pytest.mark.slow
def test_sweep_under_torchrun(tmp_path):
    """-m cp.degree=1,2 on 2 ranks: two runs in one process group, each printed once (rank 0)."""
    out = torchrun("launch.train", 2, "-m", "cp.degree=1,2", "trainer.steps=1", *TINY,
                   f"run_dir={tmp_path}/cp${{cp.degree}}", f"hydra.sweep.dir={tmp_path}")
    assert out.count("world 2 = dp 2 x cp 1") == 1 and out.count("world 2 = dp 1 x cp 2") == 1, out
    assert "#0 : cp.degree=1" in out and "#1 : cp.degree=2" in out
    for d in ("cp1", "cp2"):
        assert len((tmp_path / d / "metrics.jsonl").read_text().splitlines()) == 1
