"""Flux.1: a flow-matching transformer on 2x2-packed 16-channel latents, conditioned on T5
sequence embeddings and the CLIP-L pooled embedding, with a guidance embedding in the
guidance-distilled checkpoints (dev)."""

from __future__ import annotations

import re

import torch

from raytuner import placement
from raytuner.families import base, objectives, parts, text
from raytuner.lora import kohya

VAE_FACTOR = 8


# Black Forest Labs' names of the Flux transformer's tensors (its releases, ComfyUI and kohya's
# sd-scripts save them so) -> diffusers' names; fused q/k/v and the single blocks' fused
# projections are split below, by the width the tensors have
_BFL = {
    "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
    "txt_in": "context_embedder",
    "img_in": "x_embedder",
    "final_layer.linear": "proj_out",
}
_BFL_DOUBLE = {
    "img_mod.lin": "norm1.linear",
    "txt_mod.lin": "norm1_context.linear",
    "img_attn.norm.query_norm.scale": "attn.norm_q.weight",
    "img_attn.norm.key_norm.scale": "attn.norm_k.weight",
    "txt_attn.norm.query_norm.scale": "attn.norm_added_q.weight",
    "txt_attn.norm.key_norm.scale": "attn.norm_added_k.weight",
    "img_mlp.0": "ff.net.0.proj",
    "img_mlp.2": "ff.net.2",
    "txt_mlp.0": "ff_context.net.0.proj",
    "txt_mlp.2": "ff_context.net.2",
    "img_attn.proj": "attn.to_out.0",
    "txt_attn.proj": "attn.to_add_out",
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}
_BFL_SINGLE = {
    "modulation.lin": "norm.linear",
    "norm.query_norm.scale": "attn.norm_q.weight",
    "norm.key_norm.scale": "attn.norm_k.weight",
    "linear2": "proj_out",
    "linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
}


def _kohya_table() -> dict[str, tuple[str, bool]]:
    """diffusers' module names (inside a block: ``attn.to_q``; outside: ``x_embedder``) -> BFL's
    name of the linear holding it, and whether that linear is fused (q, k, v in one), from the
    tables above (their norms' scales are tensors, no module a LoRA adapts)."""
    table = {}
    for where, names in (("", _BFL), ("double.", _BFL_DOUBLE), ("single.", _BFL_SINGLE)):
        for bfl, modules in names.items():
            if bfl.endswith(".scale"):
                continue
            fused = isinstance(modules, tuple)
            for module in modules if fused else (modules,):
                table[where + module] = (bfl, fused)
    return table


_KOHYA = _kohya_table()


def kohya_names(module: str) -> list[tuple[str, tuple[str, ...]]]:
    """sd-scripts' name of the Flux linear holding ``module`` (BFL's, dots as underscores) and
    the modules fused there; [] for a module it has none for (``norm_out.linear``: its halves
    are in the other order there, which no converter here undoes for a LoRA)."""
    if module in _KOHYA:
        return [(kohya.PREFIX + _KOHYA[module][0].replace(".", "_"), (module,))]
    m = re.fullmatch(r"(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)", module)
    if m is None:
        return []
    blocks, i, inner = m.groups()
    kind = "double" if blocks == "transformer_blocks" else "single"
    if f"{kind}.{inner}" not in _KOHYA:
        return []
    bfl, fused = _KOHYA[f"{kind}.{inner}"]
    name = f"{kohya.PREFIX}{kind}_blocks_{i}_{bfl.replace('.', '_')}"
    if not fused:
        return [(name, (module,))]
    pieces = (_BFL_DOUBLE if kind == "double" else _BFL_SINGLE)[bfl]
    return [(name, tuple(f"{blocks}.{i}.{p}" for p in pieces))]


def _from_bfl(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Flux transformer in BFL's layout (bare, or under ComfyUI's ``model.diffusion_model.``
    beside other parts) in diffusers' names, its width read from ``img_in``. diffusers' own
    converter assumes Flux.1's width (3072); this one is checked against it at that width in
    ``tests/families/test_single_file.py``."""
    comfy = "model.diffusion_model."
    if any(k.startswith(comfy) for k in state):
        state = {k.removeprefix(comfy): v for k, v in state.items() if k.startswith(comfy)}
    if "img_in.weight" not in state:
        return state  # not BFL's layout: diffusers' (or a broken file, which loading names)
    width = state["img_in.weight"].shape[0]
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        head, _, rest = key.partition(".")
        table, prefix, inner = _BFL, "", key
        if head in ("double_blocks", "single_blocks"):
            index, _, inner = rest.partition(".")
            table = _BFL_DOUBLE if head == "double_blocks" else _BFL_SINGLE
            block = "transformer_blocks" if head == "double_blocks" else "single_transformer_blocks"
            prefix = f"{block}.{index}."
        stem, _, leaf = inner.rpartition(".")
        target = table.get(inner) or table.get(stem)
        if inner in table:  # a norm's scale: the whole name maps
            out[prefix + target] = tensor
        elif isinstance(target, tuple):  # fused q, k, v (and the single blocks' MLP input)
            sizes = [width] * 3 + [tensor.shape[0] - 3 * width] * (len(target) - 3)
            for name, piece in zip(target, torch.split(tensor, sizes), strict=True):
                out[f"{prefix}{name}.{leaf}"] = piece
        elif target:
            out[f"{prefix}{target}.{leaf}"] = tensor
        elif stem == "final_layer.adaLN_modulation.1":  # (shift, scale) -> (scale, shift)
            shift, scale = tensor.chunk(2)
            out[f"norm_out.linear.{leaf}"] = torch.cat([scale, shift])
        else:
            raise ValueError(f"{key!r} is no tensor of a Flux transformer in BFL's layout")
    return out


def _tokenizers(source: parts.Source) -> list:
    """CLIP-L's and T5's."""
    if source.preset:
        clip = parts.tokenizer_length("flux", source, "tokenizer", 77)
        t5 = parts.tokenizer_length("flux", source, "tokenizer_2", 512)
        return [text.tiny_clip_tokenizer(clip), text.tiny_t5_tokenizer(t5)]
    from transformers import AutoTokenizer

    names = ("tokenizer", "tokenizer_2")
    return [AutoTokenizer.from_pretrained(source.repo, **source.hub(n)) for n in names]


class _FluxText(text.FrozenTextEncoders):
    """T5's last hidden state (the sequence) and CLIP-L's pooled output."""

    @torch.no_grad()
    def __call__(self, captions: list[str]) -> dict[str, torch.Tensor]:
        (clip_tok, t5_tok), (clip, t5) = self.tokenizers, self.encoders
        pooled = clip(text.tokenize(clip_tok, captions, self.device)).pooler_output
        sequence = t5(text.tokenize(t5_tok, captions, self.device)).last_hidden_state
        return {"prompt_embeds": sequence, "pooled_prompt_embeds": pooled}


def _kohya_names(config) -> kohya.Names:
    """BFL's names, the same for every Flux transformer config."""
    return kohya_names


class Flux(base.DiffusersFamily):
    name = "flux"
    objective_kind = "flow"
    # the VAE's 8 x the 2x2 packing
    geometry = base.Geometry(pixel_multiple=16, pixel_grid=16)
    blocks = base.Blocks(
        swap=("transformer_blocks", "single_transformer_blocks"),
        shard=("transformer_blocks", "single_transformer_blocks"),
        compile=("FluxTransformerBlock", "FluxSingleTransformerBlock"),
        compiled_on_gpu=1.38,  # H100 2026-11-26: 1.68 vs 1.22 samples/s (H200 2026-11-28: 1.43)
        float8_matmul=True,
    )
    # CLIP-L and T5: not trained (sd-scripts trains Flux's CLIP-L; raytuner the cache's text)
    adapters = base.Adapters(
        files=base.LoraFiles(
            "flux",
            "flux1",
            "networks.lora_flux",
            "flux-1-dev",
            "https://github.com/black-forest-labs/flux",
            lycoris="lycoris_{flat}",  # ComfyUI: flux_to_diffusers, q/k/v as slices
        ),
        kohya_names=_kohya_names,
    )
    # FluxPipeline's default: the guidance embedding's value; guidance-distilled: no
    # classifier-free guidance
    guidance = base.Guidance(default_scale=3.5, embedding=True, negative_prompt=False)
    parts = base.Parts(
        classes={
            "transformer": "diffusers.FluxTransformer2DModel",
            "vae": "diffusers.AutoencoderKL",
            "text_encoder": "transformers.CLIPTextModel",
            "text_encoder_2": "transformers.T5EncoderModel",
        },
        denoiser="transformer",
        pipeline="diffusers.FluxPipeline",
        # a Flux single file holds the transformer (BFL's layout); VAE, CLIP and T5 come from
        # model.single_file_config
        single_file=(("transformer", ""),),
    )

    def cache_shapes(
        self, width: int, height: int, frames: int = 1
    ) -> dict[str, tuple[int, ...]]:
        """What Flux.1's encoders store per image of a bucket: 16-channel latents at 1/8 of the
        pixels, T5-XXL's 512 x 4096 hidden states, CLIP-L's pooled 768."""
        latent = (16, height // VAE_FACTOR, width // VAE_FACTOR)
        return {"latent": latent, "prompt_embeds": (512, 4096), "pooled_prompt_embeds": (768,)}

    def single_file_state(self, part: str, state: dict) -> dict:
        """BFL's transformer layout in diffusers' names (see ``_from_bfl``)."""
        return _from_bfl(state)

    def image_encoder(self, source: parts.Source, device: str, weights: bool = True):
        vae = self.part(source, "vae", device, weights).requires_grad_(False)
        shift, scale = vae.config.shift_factor, vae.config.scaling_factor
        dtype = vae.dtype  # diffusers walks every module to answer: once, not each batch

        @torch.no_grad()
        def encode(pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            dist = vae.encode(placement.inputs(pixels, device, dtype)).latent_dist
            return (dist.mean - shift) * scale, dist.std * scale

        return encode

    def text_encoder(self, source: parts.Source, device: str, weights: bool = True):
        encoders = [
            self.part(source, name, device, weights) for name in ("text_encoder", "text_encoder_2")
        ]
        return _FluxText(_tokenizers(source), encoders, device)

    def loss(self, source: parts.Source, objective):
        from diffusers import FluxPipeline

        objective = objectives.objective_of_kind(self, objective)
        transformer = self.parts.classes["transformer"]
        architecture = parts.config(self.name, source, "transformer", transformer)
        guided = bool(architecture.get("guidance_embeds", False))

        ids: dict = {}  # the image's position ids, made once per bucket on the device

        def image_ids(h: int, w: int, device, dtype) -> torch.Tensor:
            key = (h, w, str(device), dtype)
            if key not in ids:  # the 2x2 packing's ids, as diffusers' Flux pipeline makes them
                ids[key] = FluxPipeline._prepare_latent_image_ids(1, h // 2, w // 2, device, dtype)
            return ids[key]

        def flux_loss(denoiser, batch) -> torch.Tensor:
            latents, text = batch["latent"], batch["prompt_embeds"]
            b, c, h, w = latents.shape
            guidance = (
                torch.full((b,), objective.guidance, device=latents.device) if guided else None
            )
            img_ids = image_ids(h, w, latents.device, latents.dtype)
            txt_ids = torch.zeros(text.shape[1], 3, device=text.device, dtype=text.dtype)
            refs, ref_ids = self.reference_tokens(batch, image_ids)

            def predict(noisy, sigmas):
                packed = FluxPipeline._pack_latents(noisy, b, c, h, w)
                out = denoiser(
                    hidden_states=torch.cat([packed, *refs], dim=1),
                    timestep=sigmas.to(latents.dtype),
                    guidance=guidance,
                    pooled_projections=batch["pooled_prompt_embeds"],
                    encoder_hidden_states=text,
                    txt_ids=txt_ids,
                    img_ids=torch.cat([img_ids, *ref_ids], dim=0),
                ).sample[:, : packed.shape[1]]  # the loss: the target's tokens alone
                return FluxPipeline._unpack_latents(out, h * VAE_FACTOR, w * VAE_FACTOR, VAE_FACTOR)

            return objectives.flow_loss(objective, batch, predict, batch.get("mask"))

        def tokens(shape: tuple[int, ...]) -> int:  # a token a 2x2 patch of latent pixels
            return (shape[2] // 2) * (shape[3] // 2)

        return objectives.Objective(objectives.flow_draw(objective, tokens), flux_loss)

    def reference_tokens(self, batch, image_ids) -> tuple[list, list]:
        """The packed tokens of a batch's references and their position ids (Flux.1 Kontext:
        concatenated after the image's, the ids' first channel 1), none for a family that
        takes no references (``references.most``) or a batch without them."""
        refs = batch.get("reference_latent")
        if not self.references.most or refs is None:
            return [], []
        from diffusers import FluxPipeline

        b, k, c, h, w = refs.shape
        tokens, ids = [], []
        for j in range(k):
            tokens.append(FluxPipeline._pack_latents(refs[:, j], b, c, h, w))
            mine = image_ids(h, w, refs.device, refs.dtype).clone()
            mine[..., 0] = 1
            ids.append(mine)
        return tokens, ids

    def pipeline_options(self, pipe) -> dict:
        """T5 tokens as the cache kept them: the tokenizer's limit, at most the pipeline's 512."""
        return {"max_sequence_length": min(512, pipe.tokenizer_2.model_max_length)}

    def preset_pipeline(self, source: parts.Source):
        from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

        clip_tok, t5_tok = _tokenizers(source)
        scheduler = FlowMatchEulerDiscreteScheduler(
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
        )
        return FluxPipeline(
            **self.preset_parts(source),
            scheduler=scheduler,
            tokenizer=clip_tok,
            tokenizer_2=t5_tok,
        )
