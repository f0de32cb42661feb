"""Run a function in N CPU processes over gloo and collect what each rank returns.

    results = run_ranks(fn, world_size, *args, timeout=120)

`fn(rank, world_size, *args)` runs in a fresh spawned process with the default process
group initialised (gloo, world_size ranks); it must be importable (module level). The call
returns the list of per-rank return values. When any rank raises, the test fails with
that rank's traceback; when a rank hangs (e.g. a collective that never completes), the
test fails after `timeout` seconds naming the ranks that did not finish, and every
process is killed so CI never hangs.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import pickle
import queue
import socket
import time
import traceback

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank: int, world_size: int, port: int, timeout: float, args, kwargs, results) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        try:
            out = fn(rank, world_size, *args, **kwargs)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0, **kwargs) -> list:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` gloo ranks; see module doc."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    # A collective that hangs must raise inside the rank before the parent gives up.
    rank_timeout = max(5.0, timeout * 0.8)
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, rank_timeout, args, kwargs, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, object] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)]
                for r in dead:
                    if r not in outputs and r not in failures:
                        failures[r] = f"process exited with code {procs[r].exitcode} without reporting"
                continue
            if ok:
                outputs[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        msg = "\n".join(f"--- rank {r} of {world_size} failed:\n{tb}" for r, tb in sorted(failures.items()))
        pytest.fail(msg, pytrace=False)
    missing = [r for r in range(world_size) if r not in outputs]
    if missing:
        pytest.fail(f"ranks {missing} of {world_size} did not finish within {timeout:.0f}s (hung collective?)", pytrace=False)
    return [outputs[r] for r in range(world_size)]


def torchrun(module: str, nproc: int, *args: str, timeout: float = 600.0) -> str:
    """Run `python -m torch.distributed.run --nproc_per_node=nproc -m module args...` from the
    repository root; assert it exits 0 and return its stdout."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "-m", module, *args]
    proc = subprocess.run(cmd, cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)}, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout
