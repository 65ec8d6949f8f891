"""The work a step does, counted (``observe/flops.py``): a model small enough to count by hand
(a convolution, a linear layer and an attention, forward and backward) gets exactly its
matmuls' and convolutions' FLOPs; gradient checkpointing adds one forward; `raytuner plan
--json` carries the step's TFLOP a sample; MFU is unknown on a CPU and where the GPU's peak is."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from raytuner.cli import main
from raytuner.observe import flops

REPO = Path(__file__).resolve().parents[1]
B, C, S = 2, 3, 5  # batch, image channels, image side
D, H = 4, 2  # token width (the convolution's channels) and attention heads
L = S * S  # tokens: one a pixel


class Tiny(torch.nn.Module):
    """A 3x3 convolution, its pixels as tokens, a linear layer making q, k and v, attention."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(C, D, 3, padding=1, bias=False)
        self.linear = torch.nn.Linear(D, 3 * D, bias=False)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        tokens = self.conv(image).flatten(2).transpose(1, 2)  # [B, L, D]
        q, k, v = self.linear(tokens).chunk(3, dim=-1)
        heads = [t.unflatten(-1, (H, D // H)).transpose(1, 2) for t in (q, k, v)]
        return F.scaled_dot_product_attention(*heads).sum()


def by_hand(recompute: bool = False) -> int:
    """2 FLOPs a multiply-add. The image needs no gradient: backward computes the
    convolution's weight gradient (its forward's FLOPs again), the linear layer's input and
    weight gradients (twice its forward's) and flash attention's backward (the scores again,
    then dV, dP, dQ and dK: 5 batched matmuls where the forward has 2)."""
    conv = 2 * B * D * S * S * C * 9
    linear = 2 * B * L * D * 3 * D
    attention = 2 * 2 * B * H * L * L * (D // H)  # q @ k^T, then @ v
    forward = conv + linear + attention
    backward = conv + 2 * linear + 5 * attention // 2
    return forward * (2 if recompute else 1) + backward


def _inputs() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(B, C, S, S)


def test_a_hand_countable_step_counts_its_flops_exactly():
    model, image = Tiny(), _inputs()
    with flops.counted() as counter:
        model(image).backward()
    assert counter.get_total_flops() == by_hand()


def test_gradient_checkpointing_counts_the_forward_again():
    model, image = Tiny(), _inputs()
    with flops.counted() as counter:
        checkpoint(model, image, use_reentrant=False).backward()
    assert counter.get_total_flops() == by_hand(recompute=True)


def test_plan_json_carries_the_tflop_of_a_sample(capsys):
    args = ["plan", str(REPO / "jobs" / "tiny.toml"), "--json", "--gpu-memory", "24GiB"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0 < result["tflops_per_sample"] < 1e-2  # the tiny model: MFLOPs, not TFLOPs


def test_mfu_is_unknown_on_a_cpu_and_for_an_unknown_peak():
    assert flops.device_peak(torch.device("cpu")) is None
    assert flops.mfu(100.0, None) is None
    assert flops.device_peak(torch.device("cpu"), given=400.0) == 400.0
    assert flops.mfu(100.0, 400.0) == 0.25
