"""What launch.train and launch.check_cp share as hydra apps.

`run_app(task, "train")` runs `task(cfg)` under `hydra.main`, so both entry points take
hydra's command line: overrides, `--help`, `--cfg job`, `-m` sweeps. They run under torchrun
or as one plain process (world size 1). Rank 0 alone writes to stdout: one `--help`, one
config, one log. A config error (a `ConfigError`, or hydra/OmegaConf refusing an override) is
printed once, by rank 0, as `error: <message>` and exits 2, with no traceback: every rank
meets the same error, since each composes and checks the same config. HYDRA_FULL_ERROR=1
brings the tracebacks back. Any other exception is a bug and keeps its traceback.
"""
from __future__ import annotations

import os
import sys
from typing import Callable

import hydra
import torch.distributed as dist
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from launch.config import CONFIG_DIR, ConfigError

CONFIG_ERRORS = (ConfigError, HydraException, OmegaConfBaseException)


class _JobConfigError(BaseException):
    """A job's config error, carried past hydra's per-job report (which catches Exception only
    and prints "Error executing job with overrides" first)."""


def process_rank() -> int:
    """This process's global rank: torchrun's RANK, 0 for a plain process."""
    return int(os.environ.get("RANK", "0"))


def error_message(e: BaseException) -> str:
    """One line for a config error: ConfigError's message; OmegaConf's as `<key>: <what>`;
    hydra's lines joined (without its config search path)."""
    if isinstance(e, ConfigError):
        return str(e)
    omega = e if isinstance(e, OmegaConfBaseException) else e.__cause__
    if isinstance(omega, OmegaConfBaseException) and getattr(omega, "full_key", None):
        return f"{omega.full_key}: {str(getattr(omega, 'msg', omega)).splitlines()[0]}"
    # e.g. "In 'train': Could not find 'model/mamba'\n\nAvailable options in 'model':\n\tgla\n\thybrid\n..."
    lines: list[list[str]] = []  # [line, *the tab-indented items listed under it]
    for raw in str(e).split("Config search path")[0].splitlines():
        if raw.strip():
            if raw.startswith("\t") and lines:
                lines[-1].append(raw.strip())
            else:
                lines.append([raw.strip()])
    joined = (head + (" " + ", ".join(items) if items else "") for head, *items in lines)
    return ". ".join(line.rstrip(".") for line in joined)


def run_app(task: Callable[[DictConfig], int | None], config_name: str, argv: list[str] | None = None) -> int:
    """Run `task(cfg)` as a hydra app on configs/<config_name>.yaml, once or per sweep job;
    `argv` replaces sys.argv[1:]. Returns the exit status: the largest `task` returned (None: 0),
    or 2 after a config error."""
    saved_argv = sys.argv
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    if process_rank() != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    saved_full_error = os.environ.get("HYDRA_FULL_ERROR")
    user_full_error = saved_full_error == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # hydra re-raises instead of printing its own report
    joined_here = not dist.is_initialized()
    status = 0

    def job(cfg: DictConfig) -> None:
        nonlocal status
        try:
            status = max(status, task(cfg) or 0)
        except CONFIG_ERRORS as e:
            if user_full_error:
                raise
            raise _JobConfigError(e) from e

    try:
        hydra.main(config_path=str(CONFIG_DIR), config_name=config_name, version_base="1.3")(job)()
    except (_JobConfigError, *CONFIG_ERRORS) as e:
        if user_full_error:
            raise
        e = e.args[0] if isinstance(e, _JobConfigError) else e
        if process_rank() == 0:
            print(f"error: {error_message(e)}", file=sys.stderr, flush=True)
        return 2
    finally:
        sys.argv = saved_argv
        if saved_full_error is None:
            del os.environ["HYDRA_FULL_ERROR"]
        else:
            os.environ["HYDRA_FULL_ERROR"] = saved_full_error
        GlobalHydra.instance().clear()  # so that load_config (compose) works after an in-process run
        if joined_here and dist.is_initialized():  # one process group serves every job of a sweep
            dist.destroy_process_group()
    return status
