"""A rank's slice of the global schedule, assembled ahead of the step by a background thread.

The cursor (epoch, next global batch) is ours, not a data iterator's: Ray 2.60's iterators
restart at the epoch start after a failure, so resuming mid-epoch exactly needs our own. The
thread walks the same deterministic schedule from the cursor, reads this rank's rows of each
global batch from the cache (only those: ``CachedDataset.batch``) and stacks them into tensors
straight into pinned memory when training on a GPU, in the cache's dtype (the step makes them
float32 on the device: half the bytes cross the bus), at most ``prefetch`` batches ahead and as
many at once, so the step only waits when the reads are slower than the step itself; that wait
is measured. With the objective's ``draw`` the thread also makes each sample's noise and
timestep (or noise level) from its seed, so the step starts no host-to-device copy of its own.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from raytuner.config import TrainConfig
from raytuner.data.reader import CachedDataset, open_dataset
from raytuner.train.schedule import (
    caption_dropped,
    epoch_batches,
    flipped,
    rank_slice,
    sample_seed,
)


def drawn(tensors: dict, seeds: list[int], draw, pin: bool) -> dict:
    """``tensors`` as a feed thread hands them to the step: with each sample's draws (``draw``,
    the objective's, from the sample's own generator as the loss would draw them; None: none)
    and, with ``pin``, every tensor in pinned memory (the rows read were stacked there already)."""
    if draw is not None:
        generators = [torch.Generator().manual_seed(s) for s in seeds]
        tensors = tensors | draw(tuple(tensors["latent"].shape), generators)
    if pin:
        tensors = {k: v if v.is_pinned() else v.pin_memory() for k, v in tensors.items()}
    return tensors


def latent_draw(mean: torch.Tensor, std: torch.Tensor, seeds: list[int]) -> torch.Tensor:
    """``mean + std * eps``: a draw from each sample's cached VAE posterior, ``eps`` from a
    stream of the sample's own seed (not its noise's): the same on any rank and after a
    resume. Drawn and returned in float32."""
    eps = torch.stack(
        [
            torch.randn(mean.shape[1:], generator=torch.Generator().manual_seed(s ^ 0x5EED))
            for s in seeds
        ]
    )
    return mean.float() + std.float() * eps


@dataclass(frozen=True)
class RankSlice:
    """One step's inputs on this rank, and where in the schedule they came from."""

    epoch: int
    index: int  # global batch index within the epoch
    count: int  # global batches in the epoch
    tensors: dict[str, torch.Tensor]
    seeds: list[int]  # per-sample noise seeds, the same whatever rank trains the sample
    ids: list[str]  # the sample log's ids of this rank's slice, in order (``CachedDataset.ids``)
    flipped: tuple[bool, ...] = ()  # which samples train on their mirror image (data.flip)
    step: int = 0  # the step it trains (1-based; 0: a feed started without the run's step)
    turn: int = 0  # the expert that step trains (model.expert = "both": mixture.phase)

    def after(self) -> tuple[int, int]:
        """The cursor after this batch: the next global batch, or the next epoch's first."""
        if self.index + 1 == self.count:
            return self.epoch + 1, 0
        return self.epoch, self.index + 1


class Feed:
    """Batches for one rank from a cursor onwards; ``next`` hands them out in schedule order."""

    def __init__(
        self,
        data: CachedDataset,
        *,
        seed: int,
        global_batch_size: int,
        remainder: str,
        rank: int,
        world: int,
        prefetch: int,
        pin: bool,
        caption_dropout: float = 0.0,
        prior_loss_weight: float = 1.0,
        tokenize=None,
        draw=None,
        turns=None,
    ) -> None:
        """``tokenize``: captions -> token ids (``text_lora.TextLora.tokens``), for a step that
        encodes them itself (``lora.text_encoder``; ``data`` opened with its captions): each
        batch then carries its rows' token ids, a dropped caption the empty one's. ``draw``:
        the objective's (``families.objectives.Objective.draw``): each batch then carries its
        samples' noise and timesteps, drawn from their seeds as the loss would draw them;
        ``turns`` (``mixture.Turns``, experts trained in turn): each batch's step picks its
        expert and that expert's draw."""
        self.data, self.seed, self.gbs, self.remainder = data, seed, global_batch_size, remainder
        self.caption_dropout, self.prior_loss_weight = caption_dropout, prior_loss_weight
        self.rank, self.world, self.pin, self.tokenize = rank, world, pin, tokenize
        self.draw, self.turns = draw, turns
        # a source's repeats are repeated appearances of its rows in the schedule
        self.rows = [i for i, n in enumerate(data.repeats) for _ in range(n)]
        buckets = data.buckets
        self.buckets = [buckets[i] for i in self.rows]
        self.ids = [data.ids[i] for i in self.rows]
        self._queue: queue.Queue = queue.Queue()  # futures of batches, in schedule order
        # a batch is submitted only for a free slot; ``next`` frees one as it takes a batch, so
        # at most ``prefetch`` batches are read ahead of the step (not one more in the thread)
        self._slots = threading.Semaphore(prefetch)
        self._assemblers = ThreadPoolExecutor(prefetch, thread_name_prefix="raytuner-assemble")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.wait_s = 0.0  # time ``next`` spent waiting for the thread, since the last reset

    def epoch(self, epoch: int) -> list[list[int]]:
        return epoch_batches(self.buckets, self.seed, epoch, self.gbs, self.remainder)

    def assemble(
        self, epoch: int, index: int, batches: list[list[int]], step: int = 0
    ) -> RankSlice:
        """This rank's slice of global batch ``index`` of ``epoch``, trained at ``step``."""
        global_batch = batches[index]
        start, stop = rank_slice(global_batch, self.rank, self.world)
        mine = global_batch[start:stop]
        seeds = [sample_seed(self.seed, epoch, index, p) for p in range(start, stop)]
        dropped = [caption_dropped(s, self.caption_dropout) for s in seeds]
        rows = [self.rows[j] for j in mine]
        pairs = zip(rows, seeds, strict=True)
        flips = [bool(self.data.flippable[i]) and flipped(s) for i, s in pairs]
        tensors = self.data.batch(rows, None, dropped, flips, pin=self.pin)
        if self.tokenize is not None:  # trained text encoders: the step encodes the captions
            tensors |= self.tokenize(self.data.captions(rows, dropped))
        if "latent_std" in tensors:  # preprocess.store_std: train on a draw, not the mean
            tensors["latent"] = latent_draw(tensors["latent"], tensors.pop("latent_std"), seeds)
        if self.data.regularization.any():  # each sample's loss weight (step.forward_backward)
            reg = self.data.regularization[rows]
            weights = [self.prior_loss_weight if r else 1.0 for r in reg]
            tensors["loss_weight"] = torch.tensor(weights, dtype=torch.float32)
        turn = self.turns.of(step) if self.turns is not None else 0
        draw = self.turns.draws[turn] if self.turns is not None else self.draw
        tensors = drawn(tensors, seeds, draw, self.pin)
        ids = [self.ids[j] for j in mine]
        flips = tuple(flips)
        return RankSlice(epoch, index, len(batches), tensors, seeds, ids, flips, step, turn)

    def _slot(self) -> bool:
        """Waits for a free slot; False once the feed is closing."""
        while not self._stop.is_set():
            if self._slots.acquire(timeout=0.1):
                return True
        return False

    def _produce(self, epoch: int, index: int, step: int) -> None:
        """Hands out the batches in schedule order, assembled up to ``prefetch`` at once (their
        reads overlap: more requests in flight, on a disk or an object store); ``step``: the
        one trained before the first."""
        try:
            while not self._stop.is_set():
                batches = self.epoch(epoch)
                for i in range(index, len(batches)):
                    if not self._slot():
                        return
                    step += 1
                    work = self._assemblers.submit(self.assemble, epoch, i, batches, step)
                    self._queue.put(work)
                epoch, index = epoch + 1, 0
        except BaseException as e:  # handed to the training thread, which raises it
            self._queue.put(e)

    def start(self, epoch: int, index: int, step: int = 0) -> Feed:
        """Hand out batches from the cursor (``epoch``, ``index``), the first at ``step + 1``
        (``step``: the run's steps trained so far)."""
        self._thread = threading.Thread(
            target=self._produce, args=(epoch, index, step), name="raytuner-feed", daemon=True
        )
        self._thread.start()
        return self

    def next(self, epoch: int, index: int) -> RankSlice:
        """The batch at cursor (epoch, index); the caller moves its cursor past it."""
        tick = time.perf_counter()
        item = self._queue.get()
        self._slots.release()
        try:
            if isinstance(item, BaseException):
                raise item
            batch = item.result()
        except BaseException as e:
            # the cause in the message: the driver gets the worker's error as text, cut short
            raise RuntimeError(
                f"reading the batch at epoch {epoch}, batch {index}: {type(e).__name__}: {e}"
            ) from e
        finally:
            self.wait_s += time.perf_counter() - tick
        if (batch.epoch, batch.index) != (epoch, index):
            raise RuntimeError(
                f"feed out of step: batch ({batch.epoch}, {batch.index}) for cursor "
                f"({epoch}, {index})"
            )
        return batch

    def take_wait(self) -> float:
        """Seconds ``next`` waited since the last call."""
        wait, self.wait_s = self.wait_s, 0.0
        return wait

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._assemblers.shutdown(wait=True, cancel_futures=True)


def open_feed(
    train: TrainConfig,
    cache: str,
    fp: str,
    manifest: dict,
    rank: int,
    world: int,
    pin: bool,
    text=None,
    draw=None,
    turns=None,
) -> Feed:
    """The feed of one rank over the committed version ``fp`` as ``manifest`` describes it (the
    one the job started with); the caller starts it at its cursor and closes it and its data.
    ``text``: the trained text encoders' LoRA (``text_lora.TextLora``): the batches carry token
    ids of the captions in place of the cached text tensors it computes; ``draw``: the
    objective's, the batches carry each sample's noise and timesteps; ``turns``: experts
    trained in turn (``mixture.Turns``)."""
    computed = text.outputs if text is not None else ()
    return Feed(
        open_dataset(cache, fp, manifest, computed),
        seed=train.seed,
        global_batch_size=train.global_batch_size,
        remainder=train.remainder,
        rank=rank,
        world=world,
        prefetch=train.prefetch,
        pin=pin,
        caption_dropout=train.caption_dropout,
        prior_loss_weight=train.prior_loss_weight,
        tokenize=text.tokens if text is not None else None,
        draw=draw,
        turns=turns,
    )
