"""A sharded worker reads the model from its files one tensor at a time
(``families/part_tensors.py``): from a diffusers folder saved in several safetensors shards, the
tensors by name are the model's own, and a worker sharded over a process group of one, built on
the meta device and filled from the folder, holds the weights ``from_pretrained`` loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file

from raytuner.families import FAMILIES
from raytuner.families.parts import Source
from raytuner.placement.strategy import SHARDED


def _folder(root: Path) -> Path:
    """The tiny Flux pipeline's transformer saved as a diffusers folder in several shards."""
    transformer = FAMILIES["flux"].denoiser(Source("tiny"))
    transformer.save_pretrained(root / "transformer", max_shard_size="50KB")
    return root


def test_a_folder_is_read_tensor_by_tensor(tmp_path):
    from raytuner.families import part_tensors

    folder = _folder(tmp_path / "model")
    index_file = folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    assert len(set(index["weight_map"].values())) > 1  # really in several files
    flux = FAMILIES["flux"]
    cls = flux.parts.classes["transformer"]
    found = part_tensors.tensors(flux, Source(str(folder)), "transformer", cls)
    expected = flux.denoiser(Source("tiny")).state_dict()
    assert type(found).__name__ == "_Safetensors" and set(found) == set(expected)
    assert all(torch.equal(found[k], expected[k]) for k in expected)


def _sharded_from_folder(rank: int, folder: str, out: str) -> None:
    from raytuner.config import LoraConfig, ModelConfig, TrainConfig
    from raytuner.placement import sharding
    from raytuner.train.model import trainable_model

    sharding.single_process_group(torch.device("cpu"))
    model = ModelConfig(family="flux", pretrained=folder)
    train = TrainConfig(output="unused", mode="full")
    cpu = torch.device("cpu")
    trained = trainable_model(model, train, LoraConfig(), FAMILIES["flux"], cpu, strategy=SHARDED)
    assert trained.weights.sharded
    state = {k: sharding.gather(v).contiguous() for k, v in trained.denoiser.state_dict().items()}
    save_file(state, out)


def test_a_sharded_worker_fills_its_rows_from_the_folder(tmp_path):
    folder = _folder(tmp_path / "model")
    out = tmp_path / "sharded.safetensors"
    mp.spawn(_sharded_from_folder, args=(str(folder), str(out)), nprocs=1)
    from safetensors.torch import load_file

    got = load_file(out)
    expected = FAMILIES["flux"].denoiser(Source("tiny")).state_dict()
    assert set(got) == set(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


LANGUAGE_MODELS = sorted(
    name for name, f in FAMILIES.items()
    if any(c.endswith(("ForCausalLM", "ForConditionalGeneration"))
           for p, c in f.parts.classes.items() if p.startswith("text_"))
)  # fmt: skip


@pytest.mark.parametrize("name", LANGUAGE_MODELS)
def test_a_language_model_caption_encoder_makes_no_logits_of_every_token_nor_a_cache(name):
    """The pipelines' encode functions read only the hidden states: the caption encoder makes
    the last token's logits alone and no key-value cache (their cached text is each family's
    pipeline's own, checked in its tests)."""
    encoder = FAMILIES[name].text_encoder(Source("tiny"), "cpu").encoders[0]
    out = encoder(input_ids=torch.tensor([[1, 2, 3, 4, 5, 6]]), output_hidden_states=True)
    assert out.logits.shape[:2] == (1, 1) and out.past_key_values is None
    assert out.hidden_states[-1].shape[1] == 6
