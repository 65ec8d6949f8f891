"""FLUX.2's caption encoders: the hidden states of three layers of a chat-templated LLM, stacked
per token, through the pipeline's own ``encode_prompt``; and the tokenizers of the presets,
built in code (no hub).

[klein] (``Flux2KleinPipeline``): Qwen3 (4B for the 4B model, 8B for the 9B one), layers 9, 18
and 27, the caption as a user turn with the assistant's turn opened and thinking off, padded on
the right with ``<|endoftext|>`` to 512 tokens. [dev] (``Flux2Pipeline``): Mistral Small 3.1
(``Mistral3ForConditionalGeneration``), layers 10, 20 and 30, the pipeline's system prompt
before the caption, padded on the left to 512 tokens. Either way every one of the 512 rows is
kept: the transformer takes no text mask, and the pad rows' hidden states depend on the caption
(Qwen3's pads attend it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raytuner import placement
from raytuner.families import parts
from raytuner.families.text import hidden_states_only

MAX_TOKENS = 512  # the pipelines' tokenizer_max_length: every caption is padded to it
# Mistral Small 3.1's control tokens, in its vocabulary's order after <unk>
MISTRAL_SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]",
                    "[/SYSTEM_PROMPT]", "[IMG]", "[IMG_BREAK]", "[IMG_END]", "<pad>")  # fmt: skip
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
# Qwen3's chat template as it renders a user turn and the assistant's turn (enable_thinking as
# the pipeline passes it); Mistral Small 3.1's for a system prompt and a user turn (a message's
# content a string or a list of text parts, as diffusers' format_input writes it)
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.content is string %}{% set text = m.content %}{% else %}"
    "{% set text = m.content | selectattr('type', 'equalto', 'text') | map(attribute='text')"
    " | join('') %}{% endif %}"
    "{% if m.role == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif m.role == 'user' %}[INST]{{ text }}[/INST]"
    "{% else %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}"
)


def _byte_vocab(specials: tuple[str, ...]) -> dict[str, int]:
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    return vocab | {s: len(vocab) + i for i, s in enumerate(specials)}


def qwen_tokenizer(family: str, source: parts.Source):
    """Qwen3's tokenizer of a folder or repo; a preset's is byte-level, built in code, with
    Qwen3's chat markers and a template that writes them as Qwen3's does."""
    if not source.preset:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source.repo, **source.hub("tokenizer"))
    from transformers import Qwen2Tokenizer

    return Qwen2Tokenizer(
        vocab=_byte_vocab(QWEN_SPECIALS),
        merges=[],
        model_max_length=parts.tokenizer_length(family, source, "tokenizer", MAX_TOKENS),
        chat_template=QWEN_TEMPLATE,
        extra_special_tokens=list(QWEN_SPECIALS[1:]),
    )


def mistral_tokenizer(family: str, source: parts.Source):
    """Mistral's tokenizer as the dev pipeline loads it (``AutoProcessor``: the released repo's
    PixtralProcessor, which needs torchvision); a preset's is byte-level, built in code, with
    Mistral's control tokens, its chat template, and padding on the left as the processor's."""
    if not source.preset:
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(source.repo, **source.hub("tokenizer"))
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = _byte_vocab(MISTRAL_SPECIALS)
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens(list(MISTRAL_SPECIALS))
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        padding_side="left",
        model_max_length=parts.tokenizer_length(family, source, "tokenizer", MAX_TOKENS),
        chat_template=MISTRAL_TEMPLATE,
    )


@dataclass(frozen=True)
class Recipe:
    """How a FLUX.2 pipeline encodes a caption: its class, the layers it stacks and the chat
    turns it writes (``add_generation_prompt``, and whether the tokenizer adds special tokens
    when it tokenizes the rendered text: its template writes Mistral's ``<s>`` itself)."""

    pipeline: str  # "Flux2KleinPipeline" / "Flux2Pipeline"
    layers: tuple[int, ...]
    system: bool  # the pipeline's system prompt first ([dev])
    generation_prompt: bool  # the assistant's turn opened, thinking off ([klein])
    special_tokens: bool  # the tokenizer adds its own on the rendered text ([klein]: none)


KLEIN = Recipe("Flux2KleinPipeline", (9, 18, 27), False, True, True)
DEV = Recipe("Flux2Pipeline", (10, 20, 30), True, False, False)


class Flux2Text:
    """The stacked hidden states of each caption's 512 tokens [B, 512, 3 x hidden], through
    the pipeline's own ``encode_prompt`` (nothing dropped: no mask reaches the transformer)."""

    ragged: tuple[str, ...] = ()

    def __init__(self, recipe: Recipe, tokenizer, encoder, device: str):
        import diffusers

        encoder = hidden_states_only(placement.move(encoder, device).eval())
        encoder.requires_grad_(False)
        self.pipe = getattr(diffusers, recipe.pipeline)(
            tokenizer=tokenizer, text_encoder=encoder, vae=None, transformer=None, scheduler=None
        )
        # encoders: what an encoder actor may split over its GPUs or offload (text.place)
        self.recipe, self.device, self.encoders = recipe, device, [encoder]
        self.tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's own
        # what renders the chat template: the tokenizer, or the processor that holds it
        has_template = getattr(self.tokenizer, "chat_template", None) is not None
        self.templating = self.tokenizer if has_template else tokenizer
        self.max_tokens = min(MAX_TOKENS, self.tokenizer.model_max_length)

    @torch.no_grad()
    def __call__(self, captions: list[str]) -> dict[str, torch.Tensor]:
        if self.device == "meta":  # raytuner plan: the same pass without the mask's values
            return {"prompt_embeds": self._every_token(captions)}
        embeds, _ = self.pipe.encode_prompt(
            list(captions),
            device=torch.device(self.device),
            max_sequence_length=self.max_tokens,
            text_encoder_out_layers=self.recipe.layers,
        )
        return {"prompt_embeds": embeds}

    def templated(self, captions: list[str]) -> list[str]:
        """The captions in the chat template, as the pipeline renders them."""
        from diffusers.pipelines.flux2.pipeline_flux2 import format_input

        if self.recipe.system:
            turns = format_input(list(captions), self.pipe.system_message)
        else:
            turns = [[{"role": "user", "content": c}] for c in captions]
        thinking = {"enable_thinking": False} if self.recipe.generation_prompt else {}
        return [
            self.templating.apply_chat_template(
                t, tokenize=False, add_generation_prompt=self.recipe.generation_prompt, **thinking
            )
            for t in turns
        ]

    def _every_token(self, captions: list[str]) -> torch.Tensor:
        """The encoder's pass over ``max_tokens`` tokens without the padding mask (the causal
        mask's shortcuts read its values, which the meta device has none of), its layers
        stacked per token as the pipeline stacks them."""
        tokens = self.tokenizer(
            self.templated(captions),
            padding="max_length",
            max_length=self.max_tokens,
            truncation=True,
            add_special_tokens=self.recipe.special_tokens,
            return_tensors="pt",
        ).to(self.device)
        # with its cache (the default): without one, transformers looks for packed sequences
        # in the position ids, which reads their values too
        hidden = self.pipe.text_encoder(
            input_ids=tokens.input_ids, output_hidden_states=True
        ).hidden_states
        out = torch.stack([hidden[k] for k in self.recipe.layers], dim=1)
        b, n, length, width = out.shape
        return out.permute(0, 2, 1, 3).reshape(b, length, n * width)

    def truncated(self, captions: list[str]) -> list[bool]:
        """Whether the templated caption has more tokens than the pipeline keeps."""
        ids = self.tokenizer(
            self.templated(captions),
            truncation=False,
            add_special_tokens=self.recipe.special_tokens,
            verbose=False,
        ).input_ids
        return [len(i) > self.max_tokens for i in ids]
