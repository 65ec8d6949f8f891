"""The global per-bucket schedule: pure functions, independent of the number of workers.

Every global batch holds rows of one bucket only, and every rank takes a slice of every global
batch, so all ranks run the same number of steps on the same tensor shapes.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict

import numpy as np


def epoch_batches(
    buckets: list[str], seed: int, epoch: int, global_batch_size: int, remainder: str
) -> list[list[int]]:
    """The epoch's global batches of row indices, in training order.

    Rows are shuffled within their bucket and cut into global batches; a bucket's last partial
    batch is dropped (``remainder="drop"``) or filled by repeating rows of the same bucket
    (``"pad"``). The batches of all buckets are then shuffled together.
    """
    rng = np.random.default_rng([seed, epoch])
    groups: dict[str, list[int]] = defaultdict(list)
    for i, bucket in enumerate(buckets):
        groups[bucket].append(i)
    batches = []
    for name in sorted(groups):
        rows = rng.permutation(groups[name])
        full = len(rows) // global_batch_size
        batches += [rows[i * global_batch_size : (i + 1) * global_batch_size] for i in range(full)]
        rest = rows[full * global_batch_size :]
        if len(rest) and remainder == "pad":
            batches.append(np.concatenate([rest, np.resize(rows, global_batch_size - len(rest))]))
    if not batches:
        raise ValueError(
            f"no bucket holds train.global_batch_size = {global_batch_size} rows: lower it "
            'or set train.remainder = "pad"'
        )
    return [batches[i].tolist() for i in rng.permutation(len(batches))]


def rank_slice(global_batch: list[int], rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of this rank's contiguous slice; sizes differ by at most one."""
    base, extra = divmod(len(global_batch), world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def caption_dropped(seed: int, probability: float) -> bool:
    """Whether the sample of ``seed`` (its ``sample_seed``) trains with the empty caption: a
    draw of its own, the same on whichever rank trains the sample."""
    return probability > 0 and np.random.default_rng([seed, 1]).random() < probability


def flipped(seed: int) -> bool:
    """Whether the sample of ``seed`` (its ``sample_seed``) trains on its mirror image, where
    its row has one (``data.flip = "random"``): a fair draw of its own, the same on whichever
    rank trains the sample and after a resume, another each epoch."""
    return bool(np.random.default_rng([seed, 2]).random() < 0.5)


def sample_seed(seed: int, epoch: int, batch_index: int, position: int) -> int:
    """The noise seed of one sample of the schedule, the same whatever rank trains it."""
    digest = hashlib.sha256(f"{seed}/{epoch}/{batch_index}/{position}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)
