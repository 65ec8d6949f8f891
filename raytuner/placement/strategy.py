"""How a run spreads its model over the training workers (``scaling.strategy``), decided once:
``Strategy.of(name)`` is asked everywhere the choice matters, and no other module compares the
setting or looks for sharded tensors to find it out again.

- **replicated** (``"ddp"``): every worker holds the whole model; DDP averages the gradients;
  rank 0 alone writes a checkpoint's files, whole tensors.
- **sharded** (``"fsdp"``): every worker holds its rows of each weight (FSDP2, ``sharding.py``),
  a block's whole weights gathered as it runs; the model is built on the meta device and each
  worker reads only its rows; every worker writes its rows of a checkpoint.
- ``"auto"`` (the default) is one of these two, decided before any worker loads weights
  (``tools/plan/auto.py``, from the memory a worker has): ``Strategy.of`` refuses it
  unresolved, so it never reaches a worker.
"""

from __future__ import annotations

from dataclasses import dataclass

# optimizers that cannot step sharded parameters (DTensors), and why
UNSHARDABLE = {
    "adamw8bit": "bitsandbytes' 8-bit kernels take plain tensors, not a worker's rows (DTensor)",
    "adafactor": "its factored state (a row and a column average per matrix) is not split by "
    "rows like the weights",
    "prodigy": "its state keeps each weight flattened, which a weight whose rows do not split "
    "evenly over the workers cannot be (DTensor)",
}


@dataclass(frozen=True)
class Strategy:
    """One of the two strategies (``REPLICATED``, ``SHARDED``)."""

    name: str  # the scaling.strategy value
    sharded: bool  # each worker holds rows of the weights, not whole weights

    @staticmethod
    def of(name: str) -> Strategy:
        """The strategy ``scaling.strategy = name`` picks (``"auto"`` decided already)."""
        if name == AUTO:
            raise ValueError(
                'scaling.strategy = "auto" reached code that needs it decided: resolve it first '
                "(tools/plan/auto.py)"
            )
        return {s.name: s for s in (REPLICATED, SHARDED)}[name]

    @staticmethod
    def pinned(name: str) -> Strategy | None:
        """The strategy the job names, or None for ``"auto"`` (not decided yet: it takes
        sharding only where sharding can take the job's settings)."""
        return None if name == AUTO else Strategy.of(name)

    @staticmethod
    def one_process(name: str) -> Strategy:
        """The strategy of a single process (the benches): ``"auto"`` is a replica (one
        process holds all of the model whichever way it is laid out)."""
        return REPLICATED if name == AUTO else Strategy.of(name)

    def wrap(self, placed, prepare):
        """The denoiser as the training step calls it: DDP-wrapped by ``prepare`` (Ray Train's
        ``prepare_model``, through ``placed.distributed``), or sharded already."""
        return placed.denoiser if self.sharded else placed.distributed(prepare)

    def alone(self, device) -> None:
        """For a single process outside Ray Train (``bench step``): a sharded model needs a
        process group, here of one (what sharding costs with nothing to share)."""
        if self.sharded:
            from raytuner.placement import sharding

            sharding.single_process_group(device)

    def writes(self, rank: int) -> bool:
        """Whether worker ``rank`` writes checkpoint files: rank 0 alone, or every worker its
        rows."""
        return self.sharded or rank == 0

    def refusal(self, *, blocks_to_swap: int, float8: bool, optimizer: str) -> str | None:
        """What of a job's settings this strategy cannot take, as ``check`` says it (the key, its
        value, why, what to set), or None. Sharded weights are gathered from the other workers
        as a block runs and stepped as rows: nothing that keeps weights elsewhere (block swap,
        float8 storage) or steps them whole (optimizers of ``UNSHARDABLE``) takes part."""
        if not self.sharded:
            return None
        fix = 'or use scaling.strategy = "ddp"'
        if blocks_to_swap:
            return (
                f"memory.blocks_to_swap = {blocks_to_swap} with scaling.strategy = "
                '"fsdp": sharded blocks are gathered from the other workers, not streamed from '
                f"host memory; set memory.blocks_to_swap = 0 (fsdp needs no block swap) {fix}"
            )
        if float8:
            return (
                'model.dtype = "float8" with scaling.strategy = "fsdp": float8 storage keeps '
                f'whole weights beside their scale; use model.dtype = "bfloat16" or "auto" {fix}'
            )
        if reason := UNSHARDABLE.get(optimizer):
            return (
                f'train.optimizer = "{optimizer}" with scaling.strategy = "fsdp": '
                f'{reason}; use train.optimizer = "adamw" {fix}'
            )
        return None


AUTO = "auto"  # the default: decided before the workers start
REPLICATED = Strategy("ddp", sharded=False)
SHARDED = Strategy("fsdp", sharded=True)
