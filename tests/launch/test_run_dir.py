"""A run directory never lies: a resume continues only the same config (but for
RESUME_MAY_CHANGE), a finished run says so, a refused run writes nothing, every run says
where it writes. launch.train's hydra app runs in this process, as a world of one."""
import io
import json
import shutil
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from launch.train import main as train_main
from launch.train import plot_losses

REPO = Path(__file__).resolve().parents[2]
TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=1", "model.head_k_dim=16", "model.head_v_dim=16",
        "data.tokens_per_batch=96", "optim.warmup_steps=1", "optim.lr=3e-3", "cp.degree=1", "trainer.steps=2",
        "trainer.ckpt_every=1", "trainer.log_every=1"]

pytestmark = pytest.mark.interpreter


def run(run_dir: Path, *overrides: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `python -m launch.train TINY run_dir=... overrides`."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        status = train_main([*TINY, f"run_dir={run_dir}", *overrides])
    return status, out.getvalue(), err.getvalue()


def files(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, str]:
    """A finished 2-step run (checkpoints at steps 1 and 2) and what it printed."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    status, out, err = run(run_dir)
    assert status == 0, err
    return run_dir, out


@pytest.fixture
def run_dir(finished, tmp_path) -> Path:
    """A copy of the finished run (run_dir is one of the keys a resume may change)."""
    shutil.copytree(finished[0], tmp_path / "run")
    return tmp_path / "run"


def test_a_run_says_where_it_writes(finished):
    run_dir, out = finished
    assert f"run_dir {run_dir}: metrics {run_dir}/metrics.jsonl, plot {run_dir}/loss.png, checkpoints " \
           f"{run_dir}/checkpoints (every 1 steps and the last)" in out
    assert "done: steps 1..2 in" in out and f"checkpoint {run_dir}/checkpoints/step_000002" in out
    assert (run_dir / "loss.png").stat().st_size > 0
    meta = OmegaConf.load(run_dir / "checkpoints" / "step_000002" / "run.yaml")
    assert meta.step == 2 and meta.dp_degree == 1 and meta.config.trainer.steps == 2


def test_finished_run_says_so_and_writes_nothing(run_dir):
    before = files(run_dir)
    status, out, err = run(run_dir)
    assert status == 0 and err == ""
    assert out.startswith(f"run complete: 2/2 steps; delete {run_dir} or raise trainer.steps\n")
    assert files(run_dir) == before


@pytest.mark.parametrize("overrides,keys", [
    (["optim.lr=0.5"], ["optim.lr: 0.003 -> 0.5"]),
    (["data=text", f"data.path={REPO / 'README.md'}"], ["data.name: 'mqar' -> 'text'", "data.path: '<absent>' -> "]),
    (["model.d_model=48", "trainer.steps=5"], ["model.d_model: 32 -> 48"]),
])
def test_another_config_is_refused(run_dir, overrides, keys):
    before = files(run_dir)
    status, out, err = run(run_dir, *overrides)
    assert status == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"error: {run_dir} holds a checkpoint (step_000002) of another config: ")
    assert all(k in err for k in keys), err
    assert "trainer.steps" not in err.split("A resume may change only")[0]  # allowed to change: not a difference
    assert files(run_dir) == before


def test_bad_value_and_resume_false_are_refused(run_dir):
    before = files(run_dir)
    status, _, err = run(run_dir, "cp.comm=bogus")
    assert status == 2 and err == "error: cp.comm must be one of ['all_gather', 'send_recv'], got 'bogus'\n"
    status, _, err = run(run_dir, "trainer.resume=false", "trainer.steps=3")
    assert status == 2 and err.startswith(f"error: trainer.resume=false, but {run_dir} holds a checkpoint")
    (run_dir / "checkpoints" / "step_000002" / "run.yaml").unlink()
    before = files(run_dir)
    status, _, err = run(run_dir, "trainer.steps=3")
    assert status == 2 and "step_000002 has no run.yaml, so its config cannot be checked" in err
    assert files(run_dir) == before


def test_allowed_changes_resume(run_dir):
    old_records = (run_dir / "metrics.jsonl").read_text().splitlines()
    status, out, err = run(run_dir, "trainer.steps=3", "cp.comm=send_recv", "trainer.log_every=2")
    assert status == 0, err
    assert f"resuming from {run_dir}/checkpoints/step_000002 at step 2, to step 3" in out
    records = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert records[:2] == old_records and json.loads(records[2])["step"] == 3 and json.loads(records[2])["resumed"]
    saved = OmegaConf.load(run_dir / "config.yaml")
    assert saved.trainer.steps == 3 and saved.cp.comm == "send_recv"
    assert (run_dir / "checkpoints" / "step_000003" / "run.yaml").exists()


def test_plot_marks_resumes_and_chance(tmp_path):
    records = [{"step": s, "loss": 3.0 - 0.1 * s, "acc": 0.05 * s, **({"resumed": True} if s == 4 else {})}
               for s in range(1, 8)]
    plot_losses(records, tmp_path / "loss.png", chance=1 / 16, acc_label="recall accuracy")
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
