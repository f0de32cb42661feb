"""Train a small GLA/KDA (or hybrid) language model with data x context parallelism.

    torchrun --nproc_per_node=2 -m launch.train                      # tiny KDA, cp.degree=2, MQAR
    torchrun --nproc_per_node=4 -m launch.train cp.degree=2 model=gla data=text data.path=README.md
    torchrun --nproc_per_node=2 -m launch.train model=hybrid cp.layout=zigzag
    python -m launch.train cp.degree=1                               # one process, a world of one
    python -m launch.train --help | --cfg job | -m cp.degree=1,2     # hydra's flags (launch/cli.py)

A run directory holds one run: config.yaml, metrics.jsonl, loss.png and checkpoints/, each
checkpoint with the config that made it (run.yaml). A run resumes from the latest checkpoint
only with the same config, but for launch/config.py's RESUME_MAY_CHANGE; a finished run says so.

The world is a ("dp", "cp") device mesh. The ranks of a CP group build the same packed
batch and each keeps its shard of tokens in the layout cp.layout (`build_cp_context` +
`shard`: one contiguous slice, or zigzag's two parts); DP
groups get different batches. Each rank's loss is its token-loss sum divided by the target
count of ALL batches in the world, so an all-reduce SUM of the gradients over the whole
world gives the gradient of the global mean loss, whatever the CP degree.
"""
from __future__ import annotations

# cp_linattn first: without a GPU it selects the Triton interpreter before triton loads
import cp_linattn  # noqa: F401  isort: skip

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from cp_linattn.cp.context import FLACPContext, build_cp_context, shard
from cp_linattn.models import LinearAttentionLM, build_model
from launch.cli import run_app
from launch.config import (RESUME_MAY_CHANGE, ConfigError, build_data_source, load_config,  # noqa: F401
                           resume_mismatches, validate)
from launch.data import IGNORE, Batch, build_data  # noqa: F401  (build_data: the tests' import)


@dataclass
class Env:
    """Where this rank sits: device, mesh, its CP group and DP coordinates."""

    device: torch.device
    mesh: DeviceMesh
    cp_group: dist.ProcessGroup
    cp_degree: int
    dp_rank: int
    rank: int
    amp_dtype: torch.dtype | None
    cp_layout: str = "contiguous"

    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)


def init_distributed(cfg: DictConfig) -> tuple[torch.device, torch.dtype | None]:
    """Join the default process group unless already in one (torchrun's, or under no launcher
    a world of one); (device, autocast dtype or None)."""
    cuda = torch.cuda.is_available()
    backend = ("nccl" if cuda else "gloo") if cfg.backend == "auto" else cfg.backend
    precision = ("bf16" if cuda else "fp32") if cfg.precision == "auto" else cfg.precision
    if precision == "bf16" and not cuda:
        raise ConfigError("precision=bf16 needs CUDA: the Triton interpreter computes bf16 dots wrongly")
    if backend == "nccl" and not cuda:
        raise ConfigError("backend=nccl needs CUDA; use backend=gloo (or auto)")
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        if "RANK" in os.environ:  # torchrun (or any env:// launcher)
            dist.init_process_group(backend)
        else:  # a plain `python -m launch.train`: a world of one, no port to pick
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_backend() != backend:
        raise ConfigError(f"backend={cfg.backend} ({backend}), but this process already joined a "
                          f"{dist.get_backend()} group (a sweep cannot change the backend)")
    return device, torch.bfloat16 if precision == "bf16" else None


def setup(cfg: DictConfig) -> Env:
    """Join (or reuse) the default process group and build the ("dp", "cp") mesh."""
    device, amp_dtype = init_distributed(cfg)
    world = dist.get_world_size()
    degree = cfg.cp.degree
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1 or world % degree:
        hint = (" (one process: pass cp.degree=1, or run under torchrun --nproc_per_node=N)"
                if world == 1 else "")
        raise ConfigError(f"cp.degree must be a positive int dividing the world size {world}, got {degree!r}{hint}")
    mesh = init_device_mesh(device.type, (world // degree, degree), mesh_dim_names=("dp", "cp"))
    return Env(device, mesh, mesh["cp"].get_group(), degree, mesh["dp"].get_local_rank(), dist.get_rank(), amp_dtype,
               cfg.cp.layout)


def make_model(cfg: DictConfig, env: Env) -> LinearAttentionLM:
    """The model, initialised identically on every rank from cfg.seed."""
    torch.manual_seed(cfg.seed)
    return build_model(OmegaConf.to_container(cfg.model, resolve=True)).to(env.device)


def local_batch(batch: Batch, env: Env, comm: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, FLACPContext | None]:
    """(input_ids, labels, cu_seqlens, cp_context) of this rank: its shard (layout env.cp_layout) under CP."""
    if env.cp_degree == 1:
        return batch.input_ids.to(env.device), batch.labels.to(env.device), batch.cu_seqlens.to(env.device), None
    ctx = build_cp_context(batch.cu_seqlens, env.cp_group, layout=env.cp_layout, comm=comm, device=env.device)
    return shard(batch.input_ids, ctx).to(env.device), shard(batch.labels, ctx).to(env.device), None, ctx


def forward_backward(
    model: LinearAttentionLM, env: Env, input_ids: torch.Tensor, labels: torch.Tensor,
    cu_seqlens: torch.Tensor | None, ctx: FLACPContext | None, num_targets: int | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backpropagate `sum of token losses / num_targets` (an int, or a device tensor: no host
    sync); (logits, loss sum, correct count)."""
    with env.autocast():
        logits = model(input_ids, cu_seqlens, ctx)
    flat_logits, flat_labels = logits.float().flatten(0, 1), labels.flatten()
    loss_sum = F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE, reduction="sum")
    denominator = num_targets.clamp(min=1) if isinstance(num_targets, torch.Tensor) else max(num_targets, 1)
    (loss_sum / denominator).backward()
    correct = ((flat_logits.argmax(-1) == flat_labels) & (flat_labels != IGNORE)).sum()
    return logits.detach(), loss_sum.detach(), correct


def all_reduce_gradients(model: torch.nn.Module) -> None:
    """SUM every parameter gradient over the whole world, in one flat collective."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    for g, new in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(new.view_as(g))


def lr_at(step: int, cfg: DictConfig) -> float:
    """Linear warmup to optim.lr, then cosine decay to optim.min_lr at trainer.steps."""
    o, total = cfg.optim, cfg.trainer.steps
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    progress = (step - o.warmup_steps) / max(1, total - o.warmup_steps)
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def train_step(model, optimizer, data, env: Env, cfg: DictConfig, step: int) -> dict:
    """One optimiser step. No host sync: the statistics stay device tensors (`finish_records`
    reads a window of them at once, on logging and checkpoint steps)."""
    batch = data.batch(env.dp_rank, step)
    input_ids, labels, cu_seqlens, ctx = local_batch(batch, env, cfg.cp.comm)
    num_targets = (labels != IGNORE).sum().float()
    dist.all_reduce(num_targets)
    _, loss_sum, correct = forward_backward(model, env, input_ids, labels, cu_seqlens, ctx, num_targets)
    all_reduce_gradients(model)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
    lr = lr_at(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    stats = torch.stack([loss_sum, correct.float()])
    dist.all_reduce(stats)
    return {"step": step + 1, "lr": lr, "stats": torch.stack([stats[0], stats[1], num_targets, grad_norm.float()])}


def finish_records(pending: list[dict], seconds: float) -> list[dict]:
    """The pending steps' records with plain numbers: one device-to-host read for the window
    (this is a host sync); step_time is the window's mean."""
    values = torch.stack([r.pop("stats") for r in pending]).tolist()
    for r, (loss_sum, correct, n, grad_norm) in zip(pending, values):
        n = max(n, 1.0)
        r.update(loss=loss_sum / n, acc=correct / n, grad_norm=grad_norm, step_time=seconds / len(pending))
    return pending


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint (DCP writes .metadata last)."""
    done = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / ".metadata").exists())
    return done[-1] if done else None


def checkpoint_state(model, optimizer, step: int) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)}


# Beside each checkpoint's shards: the config that produced it and its data-parallel degree,
# written before the shards (so a complete checkpoint always has it); a resume checks them.
RUN_META = "run.yaml"


def save_checkpoint(model, optimizer, cfg: DictConfig, env: Env, step: int) -> Path:
    path = Path(cfg.run_dir) / "checkpoints" / f"step_{step:06d}"
    if env.rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        meta = {"step": step, "dp_degree": env.mesh["dp"].size(), "config": OmegaConf.to_container(cfg, resolve=True)}
        OmegaConf.save(OmegaConf.create(meta), path / RUN_META)
    dcp.save(checkpoint_state(model, optimizer, step), checkpoint_id=path)
    return path


def resume_step(cfg: DictConfig, env: Env) -> tuple[int, Path | None]:
    """(the step to start from, the checkpoint to load or None). Raises ConfigError when
    run_dir holds a checkpoint this config may not continue: a different config (but for
    RESUME_MAY_CHANGE) or data-parallel degree, or trainer.resume=false."""
    run_dir = Path(cfg.run_dir)
    latest = latest_checkpoint(run_dir)
    if latest is None:
        return 0, None
    if not cfg.trainer.resume:
        raise ConfigError(f"trainer.resume=false, but {run_dir} holds a checkpoint ({latest.name}): starting over "
                          f"there would mix two runs; delete {run_dir}, pick another run_dir, or resume")
    if not (latest / RUN_META).exists():
        raise ConfigError(f"{latest} has no {RUN_META}, so its config cannot be checked; delete {run_dir} "
                          "or pick another run_dir")
    meta = OmegaConf.to_container(OmegaConf.load(latest / RUN_META))
    diffs = resume_mismatches(meta["config"], cfg, meta["dp_degree"], env.mesh["dp"].size())
    if diffs:
        raise ConfigError(f"{run_dir} holds a checkpoint ({latest.name}) of another config: {'; '.join(diffs)}. "
                          f"A resume may change only {', '.join(RESUME_MAY_CHANGE)}; delete {run_dir} or pick "
                          "another run_dir")
    return int(meta["step"]), latest


def smooth(values: list[float]) -> list[float]:
    """Trailing mean over a window of about a tenth of the run (at least 1 point)."""
    w = max(1, len(values) // 10)
    return [sum(values[max(0, i - w + 1):i + 1]) / (i + 1 - max(0, i - w + 1)) for i in range(len(values))]


def plot_losses(records: list[dict], path: Path, chance: float | None = None, acc_label: str = "accuracy") -> None:
    """Loss and accuracy against step: raw (faint) and smoothed; the chance accuracy as a
    dashed line; a dotted vertical line where a resume started."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, (ax_loss, ax_acc) = plt.subplots(2, 1, figsize=(6, 6), sharex=True)
    for ax, key, label in ((ax_loss, "loss", "loss"), (ax_acc, "acc", acc_label)):
        values = [r[key] for r in records]
        ax.plot(steps, values, color="C0", alpha=0.3, lw=1)
        ax.plot(steps, smooth(values), color="C0", lw=2, label=f"{label} (smoothed)")
        for r in records:
            if r.get("resumed"):
                ax.axvline(r["step"] - 0.5, color="gray", ls=":", lw=1)
        ax.set_ylabel(label)
    if chance is not None:
        ax_acc.axhline(chance, color="C3", ls="--", lw=1, label=f"chance ({chance:.3g})")
    if any(r.get("resumed") for r in records):
        ax_acc.plot([], [], color="gray", ls=":", label="resumed")
    ax_acc.legend(loc="upper left", fontsize="small")
    ax_acc.set_xlabel("step")
    ax_loss.set_title(path.parent.name)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def train(cfg: DictConfig) -> list[dict]:
    """Run (or resume) the training job of a validated `cfg` (`load_config`) on the current
    world; returns the records of the steps run here (every rank), the same as appended to
    run_dir/metrics.jsonl. Nothing is written before the config and the run dir are checked."""
    env = setup(cfg)
    run_dir, steps = Path(cfg.run_dir), cfg.trainer.steps
    metrics_path, plot_path = run_dir / "metrics.jsonl", run_dir / "loss.png"
    start, latest = resume_step(cfg, env)
    say = print if env.rank == 0 else (lambda *a, **k: None)
    if start >= steps:
        say(f"run complete: {start}/{steps} steps; delete {run_dir} or raise trainer.steps\n"
            f"metrics {metrics_path}, plot {plot_path}, checkpoint {latest}", flush=True)
        return []
    data = build_data_source(cfg)
    model = make_model(cfg, env)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                  weight_decay=cfg.optim.weight_decay)
    if latest is not None:
        state = checkpoint_state(model, optimizer, 0)
        dcp.load(state, checkpoint_id=latest)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        assert int(state["step"]) == start, (latest, int(state["step"]), start)
    if env.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
        # records past the checkpoint belong to the interrupted run and are about to be redone
        old = [json.loads(line) for line in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
        metrics_path.write_text("".join(json.dumps(r) + "\n" for r in old if r["step"] <= start))
    ckpts = f"{run_dir / 'checkpoints'} (every {cfg.trainer.ckpt_every} steps and the last)" if cfg.trainer.ckpt_every \
        else "none (trainer.ckpt_every=0)"
    say(f"{cfg.model.type} model, {sum(p.numel() for p in model.parameters())} parameters; "
        f"world {dist.get_world_size()} = dp {env.mesh['dp'].size()} x cp {env.cp_degree} ({env.cp_layout}); "
        f"{f'resuming from {latest} at step {start}' if latest else 'from scratch'}, to step {steps} "
        f"(log lines: means since the previous line)\n"
        f"run_dir {run_dir}: metrics {metrics_path}, plot {plot_path}, checkpoints {ckpts}", flush=True)
    records = []
    tokens_per_step = cfg.data.tokens_per_batch * env.mesh["dp"].size()
    t_start = time.perf_counter()
    pending, t0 = [], time.perf_counter()
    for step in range(start, steps):
        record = train_step(model, optimizer, data, env, cfg, step)
        if step == start and latest is not None:
            record["resumed"] = True  # loss.png marks where this session took over
        pending.append(record)
        every, done = cfg.trainer.ckpt_every, record["step"]
        log = done % cfg.trainer.log_every == 0 or done == steps
        ckpt = bool(every) and (done % every == 0 or done == steps)
        if not (log or ckpt):
            continue
        window = finish_records(pending, time.perf_counter() - t0)
        for r in window:
            r["tokens_per_s"] = tokens_per_step / r["step_time"]
        records += window
        if env.rank == 0:
            with metrics_path.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in window)
            if log:
                # means over the steps since the last line: one batch's accuracy is too noisy to read
                previous_line = (done - 1) // cfg.trainer.log_every * cfg.trainer.log_every
                lines = records[-(done - previous_line):]
                mean = {k: sum(r[k] for r in lines) / len(lines) for k in ("loss", "acc", "step_time")}
                print(f"step {done:5d} | loss {mean['loss']:.4f} | acc {mean['acc']:.3f} | "
                      f"lr {record['lr']:.2e} | {tokens_per_step / mean['step_time']:7.0f} tok/s | "
                      f"{mean['step_time']:.2f} s/step", flush=True)
        if ckpt:
            latest = save_checkpoint(model, optimizer, cfg, env, done)
        pending, t0 = [], time.perf_counter()
    if env.rank == 0:
        all_records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
        mqar = cfg.data.name == "mqar"
        plot_losses(all_records, plot_path, chance=1 / cfg.data.num_values if mqar else None,
                    acc_label="recall accuracy" if mqar else "next-byte accuracy")
    say(f"done: steps {start + 1}..{steps} in {time.perf_counter() - t_start:.0f} s; metrics {metrics_path}, "
        f"plot {plot_path}, checkpoint {latest if cfg.trainer.ckpt_every else 'none (trainer.ckpt_every=0)'}",
        flush=True)
    return records


def _job(cfg: DictConfig) -> None:
    validate(cfg)
    train(cfg)


def main(argv: list[str] | None = None) -> int:
    """`python -m launch.train` / `torchrun ... -m launch.train`: a hydra app (launch/cli.py)."""
    return run_app(_job, "train", argv)


if __name__ == "__main__":
    sys.exit(main())
