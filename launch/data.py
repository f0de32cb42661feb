"""Packed varlen batches: synthetic multi-query associative recall (MQAR) and byte-level text.

A batch is a pure function of (seed, dp_rank, step): resuming at step s regenerates exactly
the batches an uninterrupted run would see, with no data-loader state to checkpoint. Every
rank of a CP group builds the same global batch and keeps its shard.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

IGNORE = -100


@dataclass
class Batch:
    """input_ids, labels: int64 `[1, T]` (labels IGNORE where no loss); cu_seqlens `[N + 1]`."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor


def batch_generator(seed: int, dp_rank: int, step: int) -> torch.Generator:
    mixed = ((seed * 1_000_003 + dp_rank) * 1_000_003 + step) % (2**63)
    return torch.Generator().manual_seed(mixed)


def pack(documents: list[tuple[torch.Tensor, torch.Tensor]], tokens: int) -> Batch:
    """Concatenate (tokens, labels) documents into exactly `tokens` tokens; the last one is
    cut to fit (a prefix of a document is still a document)."""
    ids, labels, lens, total = [], [], [], 0
    for doc_ids, doc_labels in documents:
        n = min(len(doc_ids), tokens - total)
        ids.append(doc_ids[:n])
        labels.append(doc_labels[:n])
        lens.append(n)
        total += n
        if total == tokens:
            break
    if total != tokens:
        raise ValueError(f"documents hold {total} tokens, fewer than tokens_per_batch={tokens}")
    cu = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0)
    return Batch(torch.cat(ids)[None], torch.cat(labels)[None], cu)


class MQAR:
    """Documents `k1 v1 ... kn vn | q1 a1 ... qn an`: n key-value pairs, then every key again
    in a random order, each followed by its value. The loss is on the answers only (the label
    at each query key is its value), so accuracy there is recall accuracy. Token 0 is unused;
    keys are 1..num_keys, values follow."""

    def __init__(self, tokens_per_batch: int, num_keys: int, num_values: int, min_pairs: int, max_pairs: int,
                 vocab_size: int, seed: int) -> None:
        if not 1 <= min_pairs <= max_pairs <= num_keys:
            raise ValueError(f"data.min_pairs={min_pairs}, data.max_pairs={max_pairs}, data.num_keys={num_keys}: "
                             "need 1 <= min_pairs <= max_pairs <= num_keys")
        if vocab_size < 1 + num_keys + num_values:
            raise ValueError(f"data.vocab_size={vocab_size} must be >= 1 + num_keys + num_values = {1 + num_keys + num_values}")
        self.tokens, self.num_keys, self.num_values = tokens_per_batch, num_keys, num_values
        self.min_pairs, self.max_pairs, self.seed = min_pairs, max_pairs, seed

    def _document(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        n = int(torch.randint(self.min_pairs, self.max_pairs + 1, (), generator=gen))
        keys = torch.randperm(self.num_keys, generator=gen)[:n] + 1
        values = torch.randint(self.num_values, (n,), generator=gen) + 1 + self.num_keys
        order = torch.randperm(n, generator=gen)
        ids = torch.cat([torch.stack([keys, values], 1).flatten(), torch.stack([keys[order], values[order]], 1).flatten()])
        labels = torch.full_like(ids, IGNORE)
        labels[2 * n::2] = values[order]
        return ids, labels

    def batch(self, dp_rank: int, step: int) -> Batch:
        gen = batch_generator(self.seed, dp_rank, step)
        docs, total = [], 0
        while total < self.tokens:
            docs.append(self._document(gen))
            total += len(docs[-1][0])
        return pack(docs, self.tokens)


class ByteText:
    """Byte-level language modelling on a text file or every file under a folder. Documents
    are random spans of `min_doc_len..max_doc_len` bytes; labels are the next byte of the
    same document (none at a document's last byte)."""

    def __init__(self, path: str, tokens_per_batch: int, min_doc_len: int, max_doc_len: int, vocab_size: int,
                 seed: int) -> None:
        root = Path(path)
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        if not root.exists() or not files:
            raise ValueError(f"data.path={path!r}: no such file, or a folder without files")
        if vocab_size < 256:
            raise ValueError(f"data.vocab_size={vocab_size} must be >= 256 for byte tokens")
        self.data = torch.frombuffer(bytearray(b"".join(f.read_bytes() for f in files)), dtype=torch.uint8).long()
        if not 2 <= min_doc_len <= max_doc_len <= len(self.data):
            raise ValueError(f"data.min_doc_len={min_doc_len}, data.max_doc_len={max_doc_len}: need 2 <= min_doc_len "
                             f"<= max_doc_len <= {len(self.data)} (the bytes of data.path={path!r})")
        self.tokens, self.min_len, self.max_len, self.seed = tokens_per_batch, min_doc_len, max_doc_len, seed

    def batch(self, dp_rank: int, step: int) -> Batch:
        gen = batch_generator(self.seed, dp_rank, step)
        docs, total = [], 0
        while total < self.tokens:
            n = int(torch.randint(self.min_len, self.max_len + 1, (), generator=gen))
            start = int(torch.randint(len(self.data) - n + 1, (), generator=gen))
            ids = self.data[start:start + n]
            docs.append((ids, torch.cat([ids[1:], ids.new_full((1,), IGNORE)])))
            total += n
        return pack(docs, self.tokens)


def build_data(cfg: dict, seed: int) -> MQAR | ByteText:
    """The data source of a `data` config (`name: mqar | text`)."""
    cfg = dict(cfg)
    name = cfg.pop("name")
    if name == "mqar":
        return MQAR(seed=seed, **cfg)
    if name == "text":
        return ByteText(seed=seed, **cfg)
    raise ValueError(f"data.name must be 'mqar' or 'text', got {name!r}")
