"""The encoder pool's text encoder, sized: its weights in its dtype, a batch's activations at
``preprocess.batch_size`` captions of the family's token length (traced on the meta device),
where it goes on the GPUs an encoder actor gets (``placement.encoders.layout``) and what a
caption's text takes in the cache (``preprocess.text_dtype``). `raytuner plan` prints it; `raytuner
check` refuses, from it, a pool whose actors cannot hold their text encoder."""

from __future__ import annotations

import functools

from raytuner.config import JobConfig
from raytuner.data import cache
from raytuner.placement import encoders
from raytuner.tools.plan.meta import traced
from raytuner.tools.plan.trace import MARGIN, OVERHEAD, _one_part_bytes, _part_bytes, _source

GiB = 2**30
MOST_GPUS = 16  # the most whole GPUs preprocess.gpus_per_actor may name
# a caption the encoders see: as long as the tokenizers keep (a padded encoder pads it anyway)
CAPTION = " ".join(["a detailed photograph of a red fox in the snow at dawn"] * 64)
CAPTIONS = 100_000  # the caption count plan states the cache's text bytes for


@functools.lru_cache(maxsize=16)
def _traced(family, source, batch: int) -> dict:
    encode = family.text_encoder(source, "meta", weights=False)
    with traced() as live:
        text = encode([CAPTION] * batch)
    weights, blocks, params = 0, [], 0
    modules = getattr(encode, "encoders", [])
    for module in modules:
        w, b = encoders.block_bytes(module)
        weights, blocks = weights + w, blocks + b
        params += sum(p.numel() for p in module.parameters())
    dtypes = {str(p.dtype).removeprefix("torch.") for m in modules for p in m.parameters()}
    if not modules:  # a text encoder that names no modules: its parts' weights, unsplittable
        names = tuple(p for p in family.parts.classes if p.startswith("text_"))
        weights = sum(_one_part_bytes(family, source, n) for n in names)
    return {
        "params": params,
        "weights_bytes": weights,
        "block_bytes": blocks,
        "dtype": ", ".join(sorted(dtypes)),
        "activations_bytes": live.peak,
        "shapes": {k: tuple(v.shape[1:]) for k, v in text.items()},
        "ragged": bool(set(getattr(encode, "ragged", ())) & set(text)),
    }


def text_encoder(job: JobConfig, family) -> dict:
    """The text encoder of an encoder actor: its parameters, weights (and each repeated
    layer's), dtype, a batch's activations, its tokens, and the text bytes a caption takes
    in the cache in ``preprocess.text_dtype``."""
    pre = job.preprocess
    out = dict(_traced(family, _source(job), pre.batch_size))
    shapes = out.pop("shapes")
    tokens = max((s[0] for s in shapes.values() if len(s) > 1), default=1)
    per_caption = sum(cache.cell_bytes(s, pre.text_storage) for s in shapes.values())
    return out | {
        "batch_size": pre.batch_size,
        "tokens": tokens,
        "text_dtype": pre.text_storage,
        "text_bytes_per_caption": per_caption,
        "vae_bytes": _part_bytes(job, family, ("vae",)),
    }


def pool(job: JobConfig, family, gpu_memory: int) -> dict:
    """Where an encoder actor's text encoder goes on its GPUs of ``gpu_memory`` bytes
    (``preprocess.gpus_per_actor`` whole GPUs, ``text_encoder_offload``): the layout and,
    when it does not fit, the fewest GPUs an actor needs and whether streaming fits."""
    pre, t = job.preprocess, text_encoder(job, family)
    usable = int(gpu_memory * (1 - MARGIN)) - OVERHEAD

    def fit(gpus: int, offload: bool) -> encoders.EncoderLayout:
        weights = t["weights_bytes"] + t["vae_bytes"]  # the VAE beside it on the first GPU
        blocks, acts = t["block_bytes"], t["activations_bytes"]
        return encoders.layout(weights, blocks, acts, usable, gpus, offload)

    gpus = max(1, int(pre.gpus_per_actor))
    how = fit(gpus, pre.text_encoder_offload)
    fewest = next((n for n in range(1, MOST_GPUS + 1) if fit(n, False).fits), None)
    return t | {
        "gpus_per_actor": gpus,
        "usable_bytes": usable,
        "layout": how.how,
        "where": how.describe(),
        "per_gpu_bytes": how.per_gpu_bytes,
        "fits": how.fits,
        "fewest_gpus": fewest,
        "offload_bytes": fit(1, True).per_gpu_bytes,
        "offload_fits": fit(1, True).fits,
    }


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def lines(p: dict) -> list[str]:
    """What `raytuner plan` prints of the pool (``pool``'s figures)."""
    n = p["text_bytes_per_caption"]
    out = [
        f"  text encoder per encoder actor: {p['params'] / 1e9:,.2f} B parameters, weights "
        f"{_gib(p['weights_bytes'])} in {p['dtype']}, activations "
        f"{_gib(p['activations_bytes'])} for preprocess.batch_size = {p['batch_size']} "
        f"captions of {p['tokens']} tokens: {p['where']}, {_gib(p['per_gpu_bytes'])} a GPU "
        f"({'fits' if p['fits'] else 'does NOT fit'})",
        f"  text in the cache: {'at most ' * p['ragged']}{n / 1e6:,.3f} MB a caption in "
        f"{p['text_dtype']} ({n * CAPTIONS / 1e9:,.1f} GB for {CAPTIONS:,} captions"
        f"{'; a caption stores its own tokens alone' * p['ragged']}; preprocess.text_dtype)",
    ]
    if not p["fits"]:
        out.append(f"  the text encoder: {advice(p)}")
    return out


def advice(p: dict) -> str:
    """What makes a pool that does not fit fit: more whole GPUs an actor, streaming its
    layers, a smaller batch."""
    ways = []
    if p["fewest_gpus"] and p["fewest_gpus"] > p["gpus_per_actor"]:
        ways.append(
            f"preprocess.gpus_per_actor = {p['fewest_gpus']} (whole GPUs; its layers split "
            "over them)"
        )
    if p["offload_fits"] and p["layout"] != encoders.OFFLOAD:
        ways.append(
            "preprocess.text_encoder_offload = true (its layers streamed from host memory: "
            f"{_gib(p['offload_bytes'])} on the GPU)"
        )
    ways.append("a smaller preprocess.batch_size")
    return "set " + ", or ".join(ways)
