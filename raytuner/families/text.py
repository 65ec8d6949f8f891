"""The text encoders' shared code: the protocols of a family's caption encoder (frozen, or with
its LoRA trained: ``lora.text_encoder``), how a trained text encoder is named in LoRA files,
tokenizers and the frozen encoders' base class."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from raytuner import placement


class TextEncoder(Protocol):
    # name -> [B, ...]; a family whose text encoder sees the references (``References.text``)
    # also takes ``references=``: each caption's reference images (PIL RGB, their bucket's size)
    def __call__(self, captions: list[str]) -> dict[str, torch.Tensor]: ...
    def truncated(self, captions: list[str]) -> list[bool]: ...  # longer than the tokenizer limit

    # the text tensors [B, tokens, ...] whose trailing all-zero rows are padding after a caption
    # of fewer tokens than the batch's longest: the cache stores each caption's rows without
    # them and the feed pads them back to the batch's longest (an encoder without the
    # attribute: none; Z-Image's variable-length captions)
    ragged: tuple[str, ...]
    # its modules, and where its inputs go: what an encoder actor places over its GPUs when
    # the encoder does not fit one (``place``)
    encoders: list[nn.Module]
    device: str


class TrainableTextEncoder(TextEncoder, Protocol):
    """The text encoders of a family whose ``adapters.text_encoders`` are trained
    (``lora.text_encoder``): captions to token ids (the feed's work), and token ids to the text
    tensors with gradients (the step's); ``__call__`` is both without gradients."""

    encoders: list[nn.Module]  # in the order of the family's adapters.text_encoders
    outputs: tuple[str, ...]  # the text tensors ``embed`` makes (the cached ones it replaces)

    def tokens(self, captions: list[str], device) -> dict[str, torch.Tensor]: ...
    def embed(self, tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


@dataclass(frozen=True)
class TextEncoderLora:
    """A text encoder ``lora.text_encoder`` trains a LoRA on, as the LoRA files name it."""

    part: str  # its pipeline part: the prefix of its keys in the diffusers file
    kohya: str  # the prefix of its LoRA's names in sd-scripts' layout (lora_te, lora_te1, ...)
    # the module its files' names start from: sd-scripts and diffusers name a CLIP's modules
    # from transformers 4's CLIPTextModel (``text_model.encoder.layers.0...``), which
    # transformers 5 flattened (``encoder.layers.0...``): added where the model lacks it
    root: str = "text_model."


def tiny_clip_tokenizer(max_length: int = 77):
    """A byte-level CLIP tokenizer built in code: one token per byte, no merges, no download."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    chars = sorted(ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


# what kohya's sd-scripts and diffusers' training scripts adapt in a CLIP text encoder: the
# attention's projections (sd-scripts adds the MLP's fc1 and fc2: lora.text_encoder_target_modules)
CLIP_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")
# the token ids of a caption batch, one tensor per tokenizer ([B, its length], int64)
TOKENS = ("input_ids", "input_ids_2")


class FrozenTextEncoders:
    """Tokenizers and their encoders, frozen in eval mode on ``device``; a family's subclass
    defines ``embed`` (token ids -> its named text tensors, ``outputs``), or ``__call__``
    (captions -> the same) where its encoders are never trained."""

    outputs: tuple[str, ...] = ()
    ragged: tuple[str, ...] = ()

    def __init__(self, tokenizers, encoders, device: str):
        self.tokenizers = tokenizers
        self.encoders = [placement.move(e, device).eval().requires_grad_(False) for e in encoders]
        self.device = device
        self._tokenizing = threading.Lock()  # the feed's threads share the tokenizers

    def truncated(self, captions: list[str]) -> list[bool]:
        return truncated(self.tokenizers, captions)

    def tokens(self, captions: list[str], device) -> dict[str, torch.Tensor]:
        """Each tokenizer's ids of ``captions`` on ``device``: ``input_ids``, ``input_ids_2``.
        One call at a time: a fast tokenizer sets its padding and truncation on every call, and
        two threads doing so at once fail ("Already borrowed")."""
        pairs = zip(TOKENS, self.tokenizers, strict=False)
        with self._tokenizing:
            return {name: tokenize(t, captions, device) for name, t in pairs}

    def embed(self, tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} encodes captions only (__call__)")

    def __call__(self, captions: list[str]) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return self.embed(self.tokens(captions, self.device))


def place(encoder, offload: bool, devices: list, gpu_bytes: int = 0) -> list:
    """A family's text encoder (``encoders``: its modules, built on the host; ``device``:
    where its inputs go) placed over ``devices``, an encoder actor's GPUs: each module whole
    on the first where it fits ``gpu_bytes`` (0: taken to fit), its layers split over the GPUs
    where not, or streamed from host memory with ``offload`` (``placement.encoders``). Returns
    each module's layout."""
    from raytuner.placement import encoders

    if not getattr(encoder, "encoders", None):
        raise TypeError(
            f"{type(encoder).__name__} names no modules (``encoders``): its family's text "
            "encoder cannot be split over GPUs or offloaded; set preprocess.gpus_per_actor <= 1 "
            "and preprocess.text_encoder_offload = false"
        )
    layouts, kept = [], []
    for module in encoder.encoders:
        weights, blocks = encoders.block_bytes(module)
        how = encoders.layout(weights, blocks, 0, gpu_bytes or weights, len(devices), offload)
        kept += encoders.place(module, how, devices)
        layouts.append(how)
    encoder.device, encoder.placed = str(devices[0]), kept  # the hooks live with the encoder
    return layouts


def tiny_t5_tokenizer(max_length: int):
    """A character-level T5 tokenizer built in code (Unigram over single characters): the tiny
    presets' stand-in for T5's and UMT5's (73 tokens: a tiny encoder's vocab_size)."""
    from transformers import T5Tokenizer

    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,!?'-▁"
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [(c, -1.0) for c in chars]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=max_length)


def rows_kept(batch: torch.Tensor) -> list[int]:
    """How many rows of each sample's [rows, ...] tensor in ``batch`` [B, rows, ...] come before
    its trailing all-zero rows (a ``ragged`` text tensor's padding)."""
    if not batch.shape[1]:
        return [0] * batch.shape[0]
    nonzero = (batch != 0).reshape(batch.shape[0], batch.shape[1], -1).any(dim=-1)
    last = torch.arange(1, batch.shape[1] + 1, device=batch.device) * nonzero  # [B, rows]
    return last.amax(dim=1).tolist()


def truncated(tokenizers, captions: list[str]) -> list[bool]:
    """Whether any of the tokenizers cuts the caption at its model_max_length."""
    flags = [False] * len(captions)
    for tokenizer in tokenizers:
        ids = tokenizer(captions, truncation=False, verbose=False).input_ids
        lengths = [len(i) for i in ids]
        flags = [f or n > tokenizer.model_max_length for f, n in zip(flags, lengths, strict=True)]
    return flags


def tokenize(tokenizer, captions: list[str], device: str) -> torch.Tensor:
    return tokenizer(
        captions,
        padding="max_length",
        max_length=tokenizer.model_max_length,
        truncation=True,
        return_tensors="pt",
    ).input_ids.to(device)  # token ids, made for the encoder's device


def hidden_states_only(encoder: nn.Module) -> nn.Module:
    """A language model that encodes captions (Qwen2.5-VL, Mistral 3, Qwen3, Gemma 3: its
    hidden states are read) makes the logits of the last token alone (``logits_to_keep=1``)
    and no key-value cache (``use_cache=False``) where its caller asks nothing else. The
    pipelines' encode functions call the whole model and read only its ``hidden_states``:
    every token's logits are [B, L, vocab] (304 KB a token for Qwen's 152,064 in bfloat16; the
    head is 8 % of Qwen2.5-VL 7B's FLOPs), and the cache every layer's keys and values, kept
    while the caller holds the output (Gemma 3 12B: 1.5 GiB for 4 captions of 1,024 tokens).
    The hidden states are the model's own. On the meta device (``raytuner plan``) the cache is
    still made, and counted: without it and without a mask, transformers reads the position
    ids' values, which meta tensors have none of."""

    def last_token(module, args, kwargs):
        kwargs.setdefault("logits_to_keep", 1)
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None or ids.device.type != "meta":
            kwargs.setdefault("use_cache", False)
        return args, kwargs

    encoder.register_forward_pre_hook(last_token, with_kwargs=True)
    return encoder
