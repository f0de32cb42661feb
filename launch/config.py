"""The launch configs' schema, their validation, and what a resume may change.

configs/*.yaml hold the values; the dataclasses here hold the types. They are registered in
hydra's ConfigStore and each yaml file starts from its schema (`defaults: [train_schema, ...]`,
`/mqar_schema@_here_`), so hydra checks every value's type and refuses unknown keys while it
composes, naming the key. `validate` then checks what a type cannot say (choices, ranges,
required values) before a run writes anything. Every such error is a `ConfigError`; the entry
points print it as one line, `error: <message>`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from cp_linattn.cp.context import COMM_MODES, LAYOUTS
from cp_linattn.layers.gla import load_chunk_gla
from cp_linattn.layers.kda import load_chunk_kda
from cp_linattn.models.lm import LMConfig

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
BACKENDS = ("auto", "nccl", "gloo")
PRECISIONS = ("auto", "fp32", "bf16")

# What a resume may change (the one place that says so). The run's length and bookkeeping,
# and how the same steps are laid out on the ranks: CP gives every rank a slice of the same
# batches, whatever cp.degree, cp.comm, cp.layout and the backend. Changing trainer.steps
# stretches or shrinks the cosine schedule of the steps still to come. The data-parallel
# degree (world size / cp.degree) fixes how many batches a step takes, so it must not change:
# `resume_mismatches` checks it beside the config. Anything else changes the math of the
# steps to come or the meaning of those done, and a resume with it is refused.
# model.ops only picks whose kernels (ours or FLA's) compute the same math on the same parameters.
RESUME_MAY_CHANGE = ("trainer.steps", "trainer.log_every", "trainer.ckpt_every", "trainer.resume",
                     "cp.degree", "cp.comm", "cp.layout", "backend", "run_dir", "check.tol", "model.ops")


class ConfigError(ValueError):
    """A config value or a run directory that cannot be used; the message names the key."""


@dataclass
class CPConfig:
    """cp.*: context parallelism."""

    degree: int = MISSING  # ranks per CP group; divides the world size (world / degree = data-parallel degree)
    comm: str = MISSING  # boundary-state transport: all_gather | send_recv
    layout: str = MISSING  # tokens per rank: contiguous (one slice) | zigzag (parts r and 2W-1-r of 2W)


@dataclass
class OptimConfig:
    """optim.*: AdamW with linear warmup, then cosine decay to min_lr at trainer.steps."""

    lr: float = MISSING  # peak learning rate, > 0
    min_lr: float = MISSING  # learning rate at trainer.steps, 0 <= min_lr <= lr
    warmup_steps: int = MISSING  # steps of linear warmup from lr / warmup_steps, >= 0
    weight_decay: float = MISSING  # AdamW's decoupled weight decay, >= 0
    betas: list[float] = MISSING  # AdamW's (beta1, beta2), each in [0, 1)
    grad_clip: float = MISSING  # clip the global gradient norm to this, > 0


@dataclass
class TrainerConfig:
    """trainer.*: the loop."""

    steps: int = MISSING  # optimiser steps of the whole run (a resume continues up to it), >= 1
    log_every: int = MISSING  # print a line every this many steps (and at the last), >= 1
    ckpt_every: int = MISSING  # checkpoint every this many steps; 0: never
    resume: bool = MISSING  # continue from run_dir's latest checkpoint (false: refuse a run_dir that has one)


@dataclass
class CheckConfig:
    """check.*: launch.check_cp."""

    tol: Optional[float] = None  # largest relative difference allowed; null: 1e-4 in fp32, 3e-2 under bf16


@dataclass
class MQARConfig:
    """data=mqar: synthetic multi-query associative recall (launch.data.MQAR)."""

    name: str = "mqar"  # the data source (set by the group option)
    tokens_per_batch: int = MISSING  # packed length T of one data-parallel batch (split over the CP group)
    num_keys: int = MISSING  # key tokens 1..num_keys
    num_values: int = MISSING  # value tokens after the keys; recall's chance accuracy is 1 / num_values
    min_pairs: int = MISSING  # key-value pairs per document, at least ...
    max_pairs: int = MISSING  # ... and at most (<= num_keys); a document holds 4 tokens per pair
    vocab_size: int = MISSING  # >= 1 + num_keys + num_values


@dataclass
class TextConfig:
    """data=text: byte-level language modelling on a file or a folder (launch.data.ByteText)."""

    name: str = "text"  # the data source (set by the group option)
    path: str = MISSING  # a text file, or a folder whose files are all read; required
    tokens_per_batch: int = MISSING  # packed length T of one data-parallel batch
    min_doc_len: int = MISSING  # documents are random spans of min_doc_len..max_doc_len bytes
    max_doc_len: int = MISSING
    vocab_size: int = MISSING  # >= 256 (bytes)


@dataclass
class TrainConfig:
    """The root of configs/train.yaml (launch.train and launch.check_cp)."""

    # model=kda | gla | hybrid: cp_linattn.models.LMConfig, documented there. model.ops: ours | fla,
    # whose chunk_kda / chunk_gla the linear-attention layers call (default ours; hybrid: its
    # softmax attention is ours either way): fla is FLA 0.6.0's, with the same arguments, for
    # benchmarks against it; it needs cp.degree=1 and FLA 0.6.0 installed.
    model: LMConfig = MISSING
    data: Any = MISSING  # data=mqar | text: MQARConfig or TextConfig
    seed: int = MISSING  # model init and data; a batch is a function of (seed, dp rank, step)
    backend: str = MISSING  # auto (nccl on CUDA, else gloo) | nccl | gloo
    precision: str = MISSING  # auto (bf16 autocast on CUDA, else fp32) | fp32 | bf16
    run_dir: str = MISSING  # config.yaml, metrics.jsonl, loss.png and checkpoints/ of the run
    cp: CPConfig = field(default_factory=CPConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    check: CheckConfig = field(default_factory=CheckConfig)


_store = ConfigStore.instance()
_store.store(name="train_schema", node=TrainConfig)
# root-level names, not options of the model/data groups: `--help` lists only the real options
_store.store(name="mqar_schema", node=MQARConfig)
_store.store(name="text_schema", node=TextConfig)


def load_config(overrides: list[str] | tuple[str, ...] = (), config_name: str = "train") -> DictConfig:
    """configs/<config_name>.yaml with hydra command-line style overrides (`cp.degree=4`,
    `model=gla`), composed and validated (`validate`)."""
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name, overrides=list(overrides))
    validate(cfg)
    return cfg


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key} must be one of {list(choices)}, got {value!r}")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(cfg: DictConfig) -> None:
    """Check what the schema's types cannot: required values, choices, ranges, the model's
    shape and the data source. Raises ConfigError naming the key."""
    for key in OmegaConf.missing_keys(cfg):
        if key == "data.path":
            raise ConfigError("data.path is required with data=text: pass data.path=<a text file or a folder>")
        raise ConfigError(f"{key} is required: it has no value in configs/ nor on the command line")
    _choice("backend", cfg.backend, BACKENDS)
    _choice("precision", cfg.precision, PRECISIONS)
    _choice("cp.comm", cfg.cp.comm, COMM_MODES)
    _choice("cp.layout", cfg.cp.layout, LAYOUTS)
    _check(cfg.cp.degree >= 1, f"cp.degree must be >= 1, got {cfg.cp.degree}")
    o = cfg.optim
    _check(o.lr > 0, f"optim.lr must be > 0, got {o.lr}")
    _check(0 <= o.min_lr <= o.lr, f"optim.min_lr must be in [0, optim.lr={o.lr}], got {o.min_lr}")
    _check(o.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {o.warmup_steps}")
    _check(o.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {o.weight_decay}")
    _check(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
           f"optim.betas must be two numbers in [0, 1), got {list(o.betas)}")
    _check(o.grad_clip > 0, f"optim.grad_clip must be > 0, got {o.grad_clip}")
    t = cfg.trainer
    _check(t.steps >= 1, f"trainer.steps must be >= 1, got {t.steps}")
    _check(t.log_every >= 1, f"trainer.log_every must be >= 1, got {t.log_every}")
    _check(t.ckpt_every >= 0, f"trainer.ckpt_every must be >= 0 (0: never), got {t.ckpt_every}")
    _check(cfg.data.tokens_per_batch >= 1, f"data.tokens_per_batch must be >= 1, got {cfg.data.tokens_per_batch}")
    _check(cfg.check.tol is None or cfg.check.tol > 0, f"check.tol must be > 0 or null, got {cfg.check.tol}")
    try:
        model = LMConfig(**OmegaConf.to_container(cfg.model, resolve=True))  # its checks name model.<key>
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from e
    _check(model.vocab_size >= cfg.data.vocab_size,
           f"model.vocab_size={model.vocab_size} must be >= data.vocab_size={cfg.data.vocab_size}")
    if model.ops == "fla":
        _check(cfg.cp.degree == 1, f"model.ops=fla needs cp.degree=1 (FLA's kernels do not take our CP context), "
                                   f"got cp.degree={cfg.cp.degree}")
        linear = model.linear if model.type == "hybrid" else model.type
        try:
            (load_chunk_kda if linear == "kda" else load_chunk_gla)("fla")
        except ImportError as e:
            raise ConfigError(f"model.ops=fla: {e}") from e
    build_data_source(cfg)  # the data source's own checks (ranges, data.path exists)


def build_data_source(cfg: DictConfig):
    """launch.data's source for cfg.data; its ValueErrors (which name data.<key>) as ConfigError."""
    from launch.data import build_data

    try:
        return build_data(OmegaConf.to_container(cfg.data, resolve=True), cfg.seed)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def resume_mismatches(saved: dict, cfg: DictConfig, saved_dp: int, dp: int) -> list[str]:
    """`key: saved -> now` for every difference between a checkpoint's saved config (and its
    data-parallel degree) and `cfg` that a resume may not make (RESUME_MAY_CHANGE)."""
    old, new = _flatten(saved), _flatten(OmegaConf.to_container(cfg, resolve=True))
    missing = object()
    out = [f"{k}: {old.get(k, '<absent>')!r} -> {new.get(k, '<absent>')!r}" for k in sorted(old.keys() | new.keys())
           if k not in RESUME_MAY_CHANGE and old.get(k, missing) != new.get(k, missing)]
    if saved_dp != dp:
        out.append(f"data-parallel degree (world size / cp.degree): {saved_dp} -> {dp}")
    return out
