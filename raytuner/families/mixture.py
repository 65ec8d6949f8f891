"""Every expert of a mixture of experts by noise level trained in one run (``model.expert =
"both"``: Wan 2.2 A14B's two transformers), as ai-toolkit and musubi-tuner train them.

The experts take turns by the step: step ``s`` (1-based) trains expert ``(s - 1) // every %
count`` (``model.expert_switch_every``, the first expert, high noise, first): a pure function of
the step, so every rank trains the same expert at every step, on any number of workers and
after a resume. Every sample of that step draws its noise level in that expert's range (its
``Expert.low``/``high``: the family's draw cut to it, as a run of that expert alone draws). Both
experts carry the adapter; only the active one runs forward and backward, so the other's
parameters get no gradient in that step (DDP leaves a parameter no rank used without one; AdamW,
clipping and the optimizer state skip it: its weights and moments wait for its next turn).

``ExpertMixture`` holds the experts under their pipeline parts' names (``transformer``,
``transformer_2``): the trained tensors, checkpoints and EMA carry those prefixes, and the export
writes each expert's LoRA into a folder of its own, as a run of that expert alone writes it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from raytuner.config.inputs import BOTH_EXPERTS

BOTH = BOTH_EXPERTS  # model.expert: every expert of the family, in turn


def phase(step: int, every: int, count: int) -> int:
    """The index (in the family's ``experts``) of the expert step ``step`` (1-based) trains:
    each in turn for ``every`` steps, the first one first. Step 0 (none trained yet) is the
    first's."""
    return max(step - 1, 0) // every % count


@dataclass(frozen=True)
class Turns:
    """A run's experts in turn: ``every`` steps each (``model.expert_switch_every``), ``draws``
    each expert's draw of its steps' noise and levels (``Objective.turns``)."""

    every: int
    draws: tuple

    def of(self, step: int) -> int:
        """The expert step ``step`` trains (``phase``)."""
        return phase(step, self.every, len(self.draws))


def turns_of(objective, every: int) -> Turns | None:
    """The turns of a run whose ``objective`` (a family's ``Objective``) draws for experts in
    turn; None for one denoiser."""
    draws = tuple(getattr(objective, "turns", ()))
    return Turns(every, draws) if draws else None


class ExpertMixture(nn.Module):
    """The experts of a mixture, each a denoiser under its part's name, in the family's order;
    the forward runs the active one (``activate``) alone."""

    # DDP: a step leaves the idle expert's adapter without a gradient (placement.distributed)
    leaves_parameters_unused = True

    def __init__(self, experts: dict[str, nn.Module]) -> None:
        super().__init__()
        for part, module in experts.items():
            self.add_module(part, module)
        self.parts = tuple(experts)
        self.active = 0

    def activate(self, index: int) -> None:
        """The expert of ``index`` (``phase``) runs the next forwards."""
        if not 0 <= index < len(self.parts):
            raise IndexError(f"expert {index} of a mixture of {len(self.parts)}")
        self.active = index

    def experts(self) -> Iterator[tuple[str, nn.Module]]:
        """(part, denoiser) of each expert, in order."""
        for part in self.parts:
            yield part, getattr(self, part)

    def expert_modules(self) -> list[nn.Module]:
        """Each expert's denoiser, in order (``placement.blocks`` reads their blocks)."""
        return [module for _, module in self.experts()]

    def forward(self, *args, **kwargs):
        return getattr(self, self.parts[self.active])(*args, **kwargs)

    # what training asks of a diffusers denoiser, done on every expert

    def add_adapter(self, config) -> None:
        """The same adapter (peft config) on every expert; ``peft_config`` is theirs."""
        for _, module in self.experts():
            module.add_adapter(config)
        self.peft_config = {"default": config}

    def enable_gradient_checkpointing(self, gradient_checkpointing_func=None) -> None:
        for _, module in self.experts():
            module.enable_gradient_checkpointing(gradient_checkpointing_func)

    def disable_gradient_checkpointing(self) -> None:
        for _, module in self.experts():
            module.disable_gradient_checkpointing()


def experts_of(denoiser: nn.Module) -> list[tuple[str, nn.Module]]:
    """(part, module) of each expert of a mixture; ``[("", denoiser)]`` for one denoiser."""
    if isinstance(denoiser, ExpertMixture):
        return list(denoiser.experts())
    return [("", denoiser)]


def split_state(state: dict, part: str) -> dict:
    """The tensors of ``state`` under ``part.`` (one expert's), without that prefix; all of
    them for ``part = ""``."""
    if not part:
        return dict(state)
    prefix = part + "."
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
