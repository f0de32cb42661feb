"""Check that CP changes nothing: the same model and batch with CP over all ranks and without.

    torchrun --nproc_per_node=4 -m launch.check_cp model=gla
    torchrun --nproc_per_node=2 -m launch.check_cp model=hybrid cp.layout=zigzag

Configured like launch.train (configs/check_cp.yaml extends train.yaml; cp.degree is set to the
world size, cp.layout applies), and a hydra app like it (launch/cli.py). Prints the largest
differences of the loss, the logits and every parameter gradient; exits with status 1 when
one exceeds check.tol (relative to the largest magnitude of the reference), else 0; with one
rank there is nothing to compare: an error, status 2.
"""
from __future__ import annotations

import dataclasses
import sys

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

# cp_linattn first: without a GPU it selects the Triton interpreter before triton loads
import cp_linattn  # noqa: F401  isort: skip

from cp_linattn.cp.context import unshard
from launch.cli import run_app
from launch.config import ConfigError, build_data_source, load_config, validate  # noqa: F401
from launch.train import IGNORE, forward_backward, init_distributed, local_batch, make_model, setup


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def check(cfg: DictConfig) -> dict[str, float]:
    """Relative max differences {"loss", "logits", "grad.<param>"} between CP and no CP."""
    init_distributed(cfg)
    if dist.get_world_size() == 1:
        raise ConfigError("launch.check_cp compares CP over all ranks with no CP, and with 1 rank there is "
                          "nothing to compare: run it under torchrun --nproc_per_node=N with N >= 2")
    cfg = OmegaConf.merge(cfg, {"cp": {"degree": dist.get_world_size()}})
    env = setup(cfg)
    batch = build_data_source(cfg).batch(0, 0)
    num_targets = int((batch.labels != IGNORE).sum())

    model = make_model(cfg, env)
    input_ids, labels, cu_seqlens, ctx = local_batch(batch, env, cfg.cp.comm)
    logits, loss_sum, _ = forward_backward(model, env, input_ids, labels, cu_seqlens, ctx, num_targets)
    dist.all_reduce(loss_sum)
    for p in model.parameters():
        dist.all_reduce(p.grad)
    cp = {"loss": loss_sum / num_targets, "logits": unshard(logits, ctx) if ctx is not None else logits, **{
        f"grad.{n}": g for n, g in _grads(model).items()}}

    model.zero_grad(set_to_none=True)
    no_cp = dataclasses.replace(env, cp_degree=1)
    input_ids, labels, cu_seqlens, _ = local_batch(batch, no_cp, cfg.cp.comm)
    logits, loss_sum, _ = forward_backward(model, no_cp, input_ids, labels, cu_seqlens, None, num_targets)
    ref = {"loss": loss_sum / num_targets, "logits": logits, **{f"grad.{n}": g for n, g in _grads(model).items()}}
    return {k: ((cp[k].float() - ref[k].float()).abs().max() / ref[k].float().abs().max().clamp(min=1e-12)).item()
            for k in ref}


def _job(cfg: DictConfig) -> int:
    validate(cfg)
    diffs = check(cfg)
    bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and torch.cuda.is_available())
    tol = cfg.check.tol if cfg.check.tol is not None else (3e-2 if bf16 else 1e-4)
    worst = max(diffs, key=diffs.get)
    if dist.get_rank() == 0:
        for name, d in diffs.items():
            print(f"{name:40s} max rel diff {d:.3e}{'   <-- above tol' if d > tol else ''}")
        print(f"CP over {dist.get_world_size()} ranks vs no CP ({cfg.cp.layout} layout): "
              f"worst {worst} {diffs[worst]:.3e} (tol {tol:.0e}): {'FAIL' if diffs[worst] > tol else 'OK'}", flush=True)
    return int(diffs[worst] > tol)


def main(argv: list[str] | None = None) -> int:
    """`torchrun --nproc_per_node=N -m launch.check_cp`: a hydra app (launch/cli.py)."""
    return run_app(_job, "check_cp", argv)


if __name__ == "__main__":
    sys.exit(main())
