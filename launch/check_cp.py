"""Check that CP changes nothing: the same model and batch with CP over all ranks and without.

    torchrun --nproc_per_node=4 -m launch.check_cp model=gla
    torchrun --nproc_per_node=2 -m launch.check_cp model=hybrid cp.layout=zigzag

Configured like launch.train (cp.degree is set to the world size; cp.layout applies). Prints the largest
differences of the loss, the logits and every parameter gradient; exits with status 1 when
one exceeds check.tol (relative to the largest magnitude of the reference), else 0.
"""
from __future__ import annotations

import dataclasses
import sys

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

# launch.train first: it picks the Triton mode before anything imports triton
from launch.train import (IGNORE, build_data, forward_backward, init_distributed, load_config, local_batch,
                          make_model, setup)

from cp_linattn.cp.context import unshard  # noqa: E402


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def check(cfg: DictConfig) -> dict[str, float]:
    """Relative max differences {"loss", "logits", "grad.<param>"} between CP and no CP."""
    init_distributed(cfg)
    cfg = OmegaConf.merge(cfg, {"cp": {"degree": dist.get_world_size()}})
    env = setup(cfg)
    batch = build_data(OmegaConf.to_container(cfg.data, resolve=True), cfg.seed).batch(0, 0)
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


def main(argv: list[str] | None = None) -> int:
    cfg = load_config(sys.argv[1:] if argv is None else argv)
    try:
        diffs = check(cfg)
        bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and torch.cuda.is_available())
        tol = cfg.check.tol if cfg.check.tol is not None else (3e-2 if bf16 else 1e-4)
        worst = max(diffs, key=diffs.get)
        if dist.get_rank() == 0:
            for name, d in diffs.items():
                print(f"{name:40s} max rel diff {d:.3e}{'   <-- above tol' if d > tol else ''}")
            print(f"CP over {dist.get_world_size()} ranks vs no CP ({cfg.cp.get('layout', 'contiguous')} layout): "
                  f"worst {worst} {diffs[worst]:.3e} "
                  f"(tol {tol:.0e}): {'FAIL' if diffs[worst] > tol else 'OK'}", flush=True)
        return int(diffs[worst] > tol)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
