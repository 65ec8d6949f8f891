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
from raytuner.train import recompute

REPO = Path(__file__).resolve().parents[2]
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


class _Linear(torch.autograd.Function):
    """``x @ w.T`` as a custom autograd.Function, whose forward runs with gradients off."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad @ w, grad.flatten(0, -2).t() @ x.flatten(0, -2)


class TinyFunction(Tiny):
    """``Tiny`` with its linear layer's product in ``_Linear``."""

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        tokens = self.conv(image).flatten(2).transpose(1, 2)
        q, k, v = _Linear.apply(tokens, self.linear.weight).chunk(3, dim=-1)
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


def test_model_flops_leave_out_the_recompute_hardware_flops_keep_it():
    """MFU counts the model's work, HFU what the hardware did: under gradient checkpointing
    (either torch implementation) the model's FLOPs are the plain step's, the total has the
    forward once more."""
    for reentrant in (False, True):
        model, image = Tiny(), _inputs().requires_grad_(reentrant)
        with flops.counted() as counter:
            checkpoint(model, image, use_reentrant=reentrant).backward()
        extra = 2 * B * D * S * S * C * 9 if reentrant else 0  # the image's gradient then
        assert counter.model == by_hand() + extra, reentrant
        assert counter.get_total_flops() == by_hand(recompute=True) + extra


def test_the_recompute_of_a_custom_function_is_recompute_under_raytuners_checkpointing():
    """raytuner's checkpoint function (``train/recompute.py``, the denoiser's) marks its
    recompute: a custom autograd.Function's product, recomputed with gradients off, is counted
    as recompute, not as the model's work (as under torch's checkpoint alone)."""
    model, image = TinyFunction(), _inputs()
    with flops.counted() as counter:
        recompute.checkpointed(model, image).backward()
    assert counter.model == by_hand()
    assert counter.get_total_flops() == by_hand(recompute=True)
    with flops.counted() as counter:
        checkpoint(model, image, use_reentrant=False).backward()
    linear = 2 * B * L * D * 3 * D
    assert counter.model == by_hand() + linear  # torch's: the recompute taken for backward


def test_mfu_and_hfu_of_a_window_of_known_work(monkeypatch):
    """The training metrics: 3 steps of 2e12 model FLOPs (3e12 with the recompute) in 2 s on a
    100 TFLOP/s device are 3 TFLOP/s, MFU 3 % and HFU 4.5 %."""
    from raytuner.train import loop

    clock = iter([100.0, 102.0, 102.0])  # the window opens, closes, the next opens
    monkeypatch.setattr(loop.time, "perf_counter", lambda: next(clock))
    meter = loop.Meter(torch.device("cpu"), peak=100.0)
    for _ in range(3):
        meter.add(torch.tensor(1.0), flops=3e12, model_flops=2e12)
    m = meter.flush(global_batch_size=4, wait_s=0.0)
    assert m["tflops_per_s"] == 3.0 and m["hardware_tflops_per_s"] == 4.5
    assert m["mfu"] == 0.03 and m["hfu"] == 0.045


def test_the_peak_table_names_each_gpu_and_refuses_to_guess():
    """Longer names first (an H200 NVL is not an H200 SXM); a MIG slice has a share of the GPU's
    peak, so unknown; a GPU the table lacks is unknown."""
    assert flops.peak_of("NVIDIA H100 80GB HBM3") == 989.4
    assert flops.peak_of("NVIDIA H100 PCIe") == 756.0
    assert flops.peak_of("NVIDIA H100 NVL") == 835.0
    assert flops.peak_of("NVIDIA H200") == 989.4
    assert flops.peak_of("NVIDIA H200 NVL") == 835.0
    assert flops.peak_of("NVIDIA GH200 480GB") == 989.4
    assert flops.peak_of("NVIDIA H100 80GB HBM3 MIG 1g.10gb") is None
    assert flops.peak_of("NVIDIA A100-SXM4-80GB MIG 3g.40gb") is None
    assert flops.peak_of("NVIDIA L40S") == 362.1 and flops.peak_of("NVIDIA L40") == 181.0
    assert flops.peak_of("Some Future GPU") is None
