"""Train a small GLA/KDA (or hybrid) language model with data x context parallelism.

    torchrun --nproc_per_node=2 -m launch.train                      # tiny KDA, cp.degree=2, MQAR
    torchrun --nproc_per_node=4 -m launch.train cp.degree=2 model=gla data=text data.path=README.md
    torchrun --nproc_per_node=2 -m launch.train model=hybrid cp.layout=zigzag

The world is a ("dp", "cp") device mesh. The ranks of a CP group build the same packed
batch and each keeps its shard of tokens in the layout cp.layout (`build_cp_context` +
`shard`: one contiguous slice, or zigzag's two parts); DP
groups get different batches. Each rank's loss is its token-loss sum divided by the target
count of ALL batches in the world, so an all-reduce SUM of the gradients over the whole
world gives the gradient of the global mean loss, whatever the CP degree.
"""
from __future__ import annotations

import os

import torch

# The Triton interpreter must be chosen before triton is first imported (by cp_linattn);
# without a GPU it is the only way the kernels run.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402

from cp_linattn.cp.context import LAYOUTS, FLACPContext, build_cp_context, shard  # noqa: E402
from cp_linattn.models import LinearAttentionLM, build_model  # noqa: E402
from launch.data import IGNORE, Batch, build_data  # noqa: E402

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def load_config(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """configs/train.yaml with hydra command-line style overrides (`cp.degree=4`, `model=gla`)."""
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return compose("train", overrides=list(overrides))


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
    """Join the default process group (unless already in one); (device, autocast dtype or None)."""
    cuda = torch.cuda.is_available()
    backend = ("nccl" if cuda else "gloo") if cfg.backend == "auto" else cfg.backend
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be auto, nccl or gloo, got {cfg.backend!r}")
    precision = ("bf16" if cuda else "fp32") if cfg.precision == "auto" else cfg.precision
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be auto, fp32 or bf16, got {cfg.precision!r}")
    if precision == "bf16" and not cuda:
        raise ValueError("precision=bf16 needs CUDA: the Triton interpreter computes bf16 dots wrongly")
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return device, torch.bfloat16 if precision == "bf16" else None


def cp_layout(cfg: DictConfig) -> str:
    """cfg.cp.layout (contiguous when absent), checked against the named layouts."""
    layout = cfg.cp.get("layout", "contiguous")
    if layout not in LAYOUTS:
        raise ValueError(f"cp.layout must be one of {list(LAYOUTS)}, got {layout!r}")
    return layout


def setup(cfg: DictConfig) -> Env:
    """Join (or reuse) the default process group and build the ("dp", "cp") mesh."""
    layout = cp_layout(cfg)
    device, amp_dtype = init_distributed(cfg)
    world = dist.get_world_size()
    degree = cfg.cp.degree
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1 or world % degree:
        raise ValueError(f"cp.degree must be a positive int dividing the world size {world}, got {degree!r}")
    mesh = init_device_mesh(device.type, (world // degree, degree), mesh_dim_names=("dp", "cp"))
    return Env(device, mesh, mesh["cp"].get_group(), degree, mesh["dp"].get_local_rank(), dist.get_rank(), amp_dtype,
               layout)


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
    cu_seqlens: torch.Tensor | None, ctx: FLACPContext | None, num_targets: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backpropagate `sum of token losses / num_targets`; (logits, loss sum, correct count)."""
    with env.autocast():
        logits = model(input_ids, cu_seqlens, ctx)
    flat_logits, flat_labels = logits.float().flatten(0, 1), labels.flatten()
    loss_sum = F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE, reduction="sum")
    (loss_sum / max(num_targets, 1)).backward()
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
    batch = data.batch(env.dp_rank, step)
    input_ids, labels, cu_seqlens, ctx = local_batch(batch, env, cfg.cp.comm)
    num_targets = (labels != IGNORE).sum().float()
    dist.all_reduce(num_targets)
    _, loss_sum, correct = forward_backward(model, env, input_ids, labels, cu_seqlens, ctx, int(num_targets))
    all_reduce_gradients(model)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
    lr = lr_at(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    stats = torch.stack([loss_sum, correct.float()])
    dist.all_reduce(stats)
    n = max(float(num_targets), 1.0)
    return {"step": step + 1, "loss": stats[0].item() / n, "acc": stats[1].item() / n, "lr": lr,
            "grad_norm": grad_norm.item()}


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint (DCP writes .metadata last)."""
    done = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / ".metadata").exists())
    return done[-1] if done else None


def checkpoint_state(model, optimizer, step: int) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)}


def plot_losses(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records])
    ax.set(xlabel="step", ylabel="loss", title=path.parent.name)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def train(cfg: DictConfig) -> list[dict]:
    """Run (or resume) the training job of `cfg` on the current world; returns the records
    of the steps run here (every rank), the same as written to run_dir/metrics.jsonl."""
    env = setup(cfg)
    data = build_data(OmegaConf.to_container(cfg.data, resolve=True), cfg.seed)
    model = make_model(cfg, env)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                  weight_decay=cfg.optim.weight_decay)
    run_dir = Path(cfg.run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    start = 0
    latest = latest_checkpoint(run_dir) if cfg.trainer.resume else None
    if latest is not None:
        state = checkpoint_state(model, optimizer, 0)
        dcp.load(state, checkpoint_id=latest)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = int(state["step"])
    if env.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
        # records past the checkpoint belong to the interrupted run and are about to be redone
        old = [json.loads(line) for line in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
        metrics_path.write_text("".join(json.dumps(r) + "\n" for r in old if r["step"] <= start))
        print(f"{cfg.model.type} model, {sum(p.numel() for p in model.parameters())} parameters; "
              f"world {dist.get_world_size()} = dp {env.mesh['dp'].size()} x cp {env.cp_degree} ({env.cp_layout}); "
              f"{'resuming from ' + str(latest) if latest else 'from scratch'}", flush=True)
    records = []
    tokens_per_step = cfg.data.tokens_per_batch * env.mesh["dp"].size()
    for step in range(start, cfg.trainer.steps):
        t0 = time.perf_counter()
        record = train_step(model, optimizer, data, env, cfg, step)
        record["step_time"] = time.perf_counter() - t0
        record["tokens_per_s"] = tokens_per_step / record["step_time"]
        records.append(record)
        if env.rank == 0:
            with metrics_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            if record["step"] % cfg.trainer.log_every == 0 or record["step"] == cfg.trainer.steps:
                print(f"step {record['step']:5d} | loss {record['loss']:.4f} | acc {record['acc']:.3f} | "
                      f"lr {record['lr']:.2e} | {record['tokens_per_s']:7.0f} tok/s | {record['step_time']:.2f} s/step",
                      flush=True)
        if cfg.trainer.ckpt_every and record["step"] % cfg.trainer.ckpt_every == 0:
            dcp.save(checkpoint_state(model, optimizer, record["step"]),
                     checkpoint_id=run_dir / "checkpoints" / f"step_{record['step']:06d}")
    if env.rank == 0:
        all_records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
        if all_records:
            plot_losses(all_records, run_dir / "loss.png")
    return records


def main(argv: list[str] | None = None) -> None:
    cfg = load_config(sys.argv[1:] if argv is None else argv)
    try:
        train(cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
