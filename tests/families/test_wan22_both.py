"""Wan 2.2 A14B's two experts trained in one run (``model.expert = "both"``): the experts take
turns every ``model.expert_switch_every`` steps (the high-noise one first), the same on every
rank and after a resume, each step's noise levels drawn in its expert's range; only the active
expert's LoRA gets a gradient and an update; the run exports ``lora/high/`` and ``lora/low/``,
each the files a one-expert run writes, and WanPipeline (and `raytuner sample`) render with both.
`raytuner check` refuses what such a run does not take; `plan` counts both experts. Quick tests,
in one process; the two-worker runs: ``test_wan22_both_run.py``."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from raytuner.cli import main
from raytuner.config import FlowObjective, LoraConfig, ModelConfig, TrainConfig, load_job
from raytuner.data import cache
from raytuner.data.reader import open_dataset
from raytuner.families import get_family, mixture
from raytuner.families.parts import Source
from raytuner.lora import export
from raytuner.tools import synthetic
from raytuner.train.feed import Feed

TINY = Source("tiny")
BOUNDARY = 0.875  # WanPipeline's boundary_ratio of the T2V A14B
RANGES = {"high": (BOUNDARY, 1.0), "low": (0.0, BOUNDARY)}
EVERY, STEPS = 2, 8


def _objective(sampling: str = "uniform") -> FlowObjective:
    return FlowObjective(resolution_shift=False, shift=3.0, timestep_sampling=sampling)


def _feed_steps(data, rank: int, world: int, turns, start=(0, 0, 0), steps: int = STEPS):
    """(step, turn, sigmas) of each batch a rank's feed hands out from ``start`` (epoch,
    index, steps trained before)."""
    feed = Feed(data, seed=5, global_batch_size=4, remainder="pad", rank=rank, world=world,
                prefetch=2, pin=False, turns=turns)  # fmt: skip
    feed.start(*start)
    out, cursor = [], start[:2]
    try:
        for _ in range(steps):
            batch = feed.next(*cursor)
            out.append((batch.step, batch.turn, batch.tensors["sigma"].tolist()))
            cursor = batch.after()
    finally:
        feed.close()
    return out


def test_each_step_draws_in_its_experts_range_in_turns_alike_on_every_rank(tmp_path):
    """Steps 1-2 train the high-noise expert, 3-4 the low one, and so on (switching every 2):
    every sample of a step is drawn in that expert's range on both ranks of two (the pipeline
    hands `transformer` sigma x 1000 >= 875), one rank of one draws the same levels, and a
    feed started at a checkpoint's cursor and step goes on with the same turns and levels."""
    family = get_family("wan22", mixture.BOTH)
    turns = mixture.turns_of(family.loss(TINY, _objective()), EVERY)
    assert [e.name for e in family.turns] == ["high", "low"]
    assert [turns.of(s) for s in range(1, 9)] == [0, 0, 1, 1, 0, 0, 1, 1]
    version = cache.Version(str(tmp_path), "synthetic")
    synthetic.write_cache(
        version, buckets=[(32, 32)] * 6, captions=[0] * 6, repeats=[1] * 6,
        shapes=lambda w, h: {"latent": (16, 1, h // 8, w // 8), "prompt_embeds": (3, 32)},
        family="wan22", dtype="float32",
    )  # fmt: skip
    data = open_dataset(str(tmp_path), "synthetic")
    ranks = [_feed_steps(data, r, 2, turns) for r in (0, 1)]
    one = _feed_steps(data, 0, 1, turns)
    steps = zip(*ranks, one, strict=True)
    for step, ((s0, t0, a), (s1, t1, b), (_, t, whole)) in enumerate(steps, 1):
        assert s0 == s1 == step and t0 == t1 == t == turns.of(step)
        low, high = RANGES[family.turns[t].name]
        assert all(low <= x < high for x in a + b), (step, a, b)
        assert a + b == whole  # each sample's own draw, whichever rank trains it
    resumed = _feed_steps(data, 0, 2, turns, start=(1, 1, 3), steps=STEPS - 3)  # 2 an epoch
    assert resumed == ranks[0][3:]
    data.close()


def test_only_the_active_expert_trains_and_each_exports_its_own_files(tmp_path):
    """In one process: a step of the high expert gives only its LoRA gradients (AdamW keeps no
    state for the other), the low expert's next step only the low LoRA's; the export writes
    lora/high/ and lora/low/, each diffusers' layout under ``transformer.`` and the Wan-named
    kohya file, its ``raytuner.expert`` the expert's."""
    parts = {"high": "transformer.", "low": "transformer_2."}

    def stepped(turn: int, trained, opt, before: list) -> None:
        expert, names = ("high", "low")[turn], trained.weights.names
        assert {n.split(".")[0] for n in names} == {"transformer", "transformer_2"}
        for n, p, b in zip(names, trained.weights.params, before, strict=True):
            mine = n.startswith(parts[expert])
            assert (p.grad is not None) == mine, n
            assert (p in opt.state) == (mine or turn == 1 and n.startswith(parts["high"])), n
            assert mine or torch.equal(p, b), n

    family, trained = _trained_both(LoraConfig(rank=4, alpha=4.0), tmp_path, stepped)
    trained.weights.export_lora(str(tmp_path), family, {"raytuner.expert": mixture.BOTH})
    for expert in ("high", "low"):
        folder = tmp_path / "lora" / expert
        keys = load_file(folder / "pytorch_lora_weights.safetensors")
        assert keys and all(k.startswith("transformer.blocks.") for k in keys)
        with safe_open(folder / "lora_kohya.safetensors", framework="pt") as f:
            assert f.metadata()["raytuner.expert"] == expert
            assert all(k.startswith("diffusion_model.blocks.") for k in f.keys())  # noqa: SIM118


def _trained_both(lora: LoraConfig, out, stepped=None):
    """A mixture of both experts with ``lora`` on each, a step of each expert taken (AdamW);
    ``stepped(turn, trained, opt, the parameters before)`` after each step's update."""
    from raytuner.train.model import trainable_model

    family = get_family("wan22", mixture.BOTH)
    model = ModelConfig(family="wan22", expert=mixture.BOTH)
    trained = trainable_model(model, TrainConfig(output=str(out), max_steps=2), lora, family,
                              torch.device("cpu"))  # fmt: skip
    loss_fn = family.loss(trained.source, _objective())
    opt = torch.optim.AdamW(trained.weights.params, lr=1e-2)
    for turn in (0, 1):
        trained.denoiser.activate(turn)
        gens = [torch.Generator().manual_seed(10 * turn + i) for i in range(2)]
        batch = {"latent": torch.randn(2, 16, 1, 4, 4), "prompt_embeds": torch.randn(2, 5, 32)}
        before = [p.detach().clone() for p in trained.weights.params]
        loss_fn(trained.denoiser, batch | loss_fn.draw_of(turn)((2, 16, 1, 4, 4), gens)).sum()\
            .backward()  # fmt: skip
        opt.step()
        if stepped is not None:
            stepped(turn, trained, opt, before)
        opt.zero_grad(set_to_none=True)
    return family, trained


@pytest.mark.parametrize("kind", ["lokr", "loha", "dora"])
def test_each_experts_lokr_loha_or_dora_exports_the_files_a_run_of_that_expert_writes(
    kind, tmp_path
):
    """A LoKr, LoHa or DoRA on both experts: each expert's folder holds, tensor for tensor, the
    files a run of that expert alone writes with the same adapter values (diffusers' layout,
    the LyCORIS file with DoRA's ``dora_scale``), and the pipeline renders with both."""
    from run_checks import pipeline_image

    from raytuner.lora.find import find_weights
    from raytuner.render.sample import apply_weights
    from raytuner.train.model import trainable_model

    lora = LoraConfig(rank=4, alpha=4.0, **({"dora": True} if kind == "dora" else {"kind": kind}))
    family, both = _trained_both(lora, tmp_path)

    def meta(model: ModelConfig) -> dict:  # what the worker's export writes (train/loop.py)
        return export.metadata(family="wan22", model=model, lora=lora, step=2, run="r",
                               fingerprint="f")  # fmt: skip

    both_model = ModelConfig(family="wan22", expert=mixture.BOTH)
    both.weights.export_lora(str(tmp_path / "both"), family, meta(both_model))
    values = dict(zip(both.weights.names, both.weights.params, strict=True))
    for (part, _), expert in zip(both.denoiser.experts(), ("high", "low"), strict=True):
        model = ModelConfig(family="wan22", expert=expert)
        one = trainable_model(model, TrainConfig(output=str(tmp_path), max_steps=2), lora,
                              get_family("wan22", expert), torch.device("cpu"))  # fmt: skip
        with torch.no_grad():
            for name, param in zip(one.weights.names, one.weights.params, strict=True):
                param.copy_(values[f"{part}.{name}"])
        one.weights.export_lora(str(tmp_path / expert), get_family("wan22", expert), meta(model))
        mine, alone = tmp_path / "both" / "lora" / expert, tmp_path / expert / "lora"
        files = sorted(p.name for p in alone.glob("*.safetensors"))
        assert files and sorted(p.name for p in mine.glob("*.safetensors")) == files
        for file in files:
            a, b = load_file(mine / file), load_file(alone / file)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), file
            (ma, mb) = (safe_open(f / file, "pt").metadata() for f in (mine, alone))
            timed = {"ss_training_started_at", "ss_training_finished_at"}
            other = timed | {"raytuner.expert_switch_every"}  # a run of both says it
            assert {k: v for k, v in ma.items() if k not in other} == {
                k: v for k, v in mb.items() if k not in other
            }, file
        if kind == "dora":
            lycoris = load_file(mine / "lora_kohya.safetensors")
            assert any(k.endswith(".dora_scale") for k in lycoris)
    pipe = family.pipeline(TINY)
    base = pipeline_image(pipe)
    apply_weights(pipe, family, find_weights(str(tmp_path / "both" / "lora")), "cpu")
    assert not torch.allclose(torch.from_numpy(pipeline_image(pipe)), torch.from_numpy(base))


JOB = """
[model]
family = "wan22"
expert = "both"
{more}
[data]
images = "{images}"
cache = "{root}/cache"
[train]
output = "{root}/runs"
"""

REFUSED = [
    ('train.mode="full"', "train.mode = 'full'"),
]


def test_float8_storage_and_block_swap_hold_both_experts_and_train_the_active_one():
    """``model.dtype = "float8"`` with 2 of each expert's blocks streamed: every frozen linear
    weight of both experts is stored in float8; a step of the low expert is finite and
    reaches its LoRA alone."""
    from test_lowvram import LORA, _batch, _Slice, _train

    from raytuner.config import MemoryConfig
    from raytuner.train.model import trainable_model
    from raytuner.train.step import forward_backward

    family = get_family("wan22", mixture.BOTH)
    model = ModelConfig(family="wan22", expert=mixture.BOTH, dtype="float8")
    memory = MemoryConfig(blocks_to_swap=2)
    trained = trainable_model(model, _train(), LORA, family, torch.device("cpu"), memory)
    for part, expert in trained.denoiser.experts():
        stored = [m.parametrizations.weight.original0.dtype for m in expert.modules()
                  if isinstance(m, torch.nn.Linear) and hasattr(m, "parametrizations")]  # fmt: skip
        assert stored and set(stored) == {torch.float8_e4m3fn}, part
    trained.denoiser.activate(1)
    loss_fn = family.loss(trained.source, _objective())
    tensors = _batch("wan22")
    gens = [torch.Generator().manual_seed(s) for s in (3, 4)]
    tensors = tensors | loss_fn.draw_of(1)(tuple(tensors["latent"].shape), gens)
    loss = forward_backward(trained.denoiser, loss_fn, _Slice(tensors, [3, 4]),
                            torch.device("cpu"), 0, 0.5, trained.amp)  # fmt: skip
    assert torch.isfinite(loss)
    named = zip(trained.weights.names, trained.weights.params, strict=True)
    reached = {n.split(".")[0] for n, p in named if p.grad is not None and p.grad.abs().sum() > 0}
    assert reached == {"transformer_2"}
    trained.placement.check()


def test_a_run_of_both_starts_each_expert_from_its_own_file_of_a_folder(tmp_path, capsys):
    """``lora.init_from`` of a run of both: a folder with a file per expert (a run of both's
    lora/, or another trainer's file of each expert alone in high/ and low/: here the
    Wan-named kohya files ComfyUI loads) starts each expert's adapter from its own file; the
    export names each file's sha256 by expert; `raytuner check` refuses a folder without a
    file for an expert, naming it."""
    import shutil

    from raytuner.train.model import trainable_model

    lora = LoraConfig(rank=4, alpha=4.0)
    family, trained = _trained_both(lora, tmp_path)
    trained.weights.export_lora(str(tmp_path / "first"), family, {})
    expected = {k: v.detach().clone() for k, v in trained.weights.state().items()}
    comfy = tmp_path / "comfy"
    for expert in ("high", "low"):
        (comfy / expert).mkdir(parents=True)
        shutil.copy(tmp_path / "first" / "lora" / expert / "lora_kohya.safetensors",
                    comfy / expert / f"wan22_{expert}_noise.safetensors")  # fmt: skip
    for folder in (tmp_path / "first" / "lora", comfy):
        started = LoraConfig(rank=4, alpha=4.0, init_from=str(folder))
        model = ModelConfig(family="wan22", expert=mixture.BOTH)
        again = trainable_model(model, TrainConfig(output=str(tmp_path), max_steps=2), started,
                                family, torch.device("cpu"))  # fmt: skip
        state = again.weights.state()
        assert state.keys() == expected.keys()
        assert all(torch.allclose(state[k], expected[k], atol=1e-6) for k in state), folder
        shas = json.loads(again.weights.provenance["raytuner.init_from_sha256"])
        assert sorted(shas) == ["high", "low"], shas
    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (64, 64)).save(images / "a.png")
    job = tmp_path / "a14b.toml"
    job.write_text(JOB.format(more="", images=images, root=tmp_path))
    sets = ["--set", f'lora.init_from="{comfy}"', "--set", "lora.rank=4", "--set", "lora.alpha=4"]
    assert main(["check", str(job), *sets]) == 0, capsys.readouterr().err
    capsys.readouterr()
    (comfy / "low" / "wan22_low_noise.safetensors").unlink()
    assert main(["check", str(job), *sets]) == 2
    err = capsys.readouterr().err
    assert "its low/ folder holds 0 .safetensors files" in err, err


def test_each_merged_adapter_goes_into_its_expert_as_a_run_of_that_expert_merges_it(
    tmp_path, capsys
):
    """``[[model.merge_adapters]]`` of a run of both: each entry names its expert, and each
    expert's frozen weights (replicated, sharded, and in the pipeline validation and `sample`
    load) equal those of a run of that expert alone with its entries; `raytuner check` refuses
    an entry without its expert, and one naming the expert a one-expert run does not train."""
    import torch.distributed as dist

    from raytuner.config import MergeAdapterConfig
    from raytuner.placement import sharding
    from raytuner.placement.strategy import SHARDED
    from raytuner.render.sample import load_pipeline
    from raytuner.train.model import trainable_model

    family, trained = _trained_both(LoraConfig(rank=4, alpha=4.0), tmp_path)
    trained.weights.export_lora(str(tmp_path / "first"), family, {})
    files = {e: str(tmp_path / "first" / "lora" / e / "pytorch_lora_weights.safetensors")
             for e in ("high", "low")}  # fmt: skip
    entries = [MergeAdapterConfig(path=files["low"], weight=0.5, expert="low"),
               MergeAdapterConfig(path=files["high"], expert="high")]  # fmt: skip
    train, lora, cpu = TrainConfig(output=str(tmp_path), max_steps=2), LoraConfig(), "cpu"

    def frozen(model_config, strategy=None, family=family) -> dict[str, torch.Tensor]:
        kw = {"strategy": strategy} if strategy else {}
        built = trainable_model(model_config, train, lora, family, torch.device(cpu), **kw)
        return {k.replace(".base_layer", ""): sharding.gather(v).detach().clone()
                for k, v in built.denoiser.named_parameters() if not v.requires_grad}  # fmt: skip

    both = ModelConfig(family="wan22", expert=mixture.BOTH, merge_adapters=entries)
    merged = frozen(both)
    made = not dist.is_initialized()  # a process group of one, left as it was found
    sharding.single_process_group(torch.device(cpu))
    try:
        sharded = frozen(both, SHARDED)
    finally:
        if made:
            dist.destroy_process_group()
    pipe = load_pipeline(family, TINY, None, cpu, merged=entries)
    for part, expert in (("transformer", "high"), ("transformer_2", "low")):
        mine = [a for a in entries if a.expert == expert]
        one = ModelConfig(family="wan22", expert=expert, merge_adapters=mine)
        alone = frozen(one, family=get_family("wan22", expert))
        ours = mixture.split_state(merged, part)
        assert ours.keys() == alone.keys()
        assert all(torch.equal(ours[k], alone[k]) for k in ours), expert
        assert all(torch.equal(sharded[f"{part}.{k}"], alone[k]) for k in alone), expert
        rendered = getattr(pipe, part).state_dict()
        assert all(torch.equal(rendered[k], alone[k]) for k in alone), expert
    base = frozen(ModelConfig(family="wan22", expert=mixture.BOTH))
    assert any(not torch.equal(base[k], merged[k]) for k in base if k.startswith("transformer_2."))

    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (64, 64)).save(images / "a.png")
    job = tmp_path / "a14b.toml"
    entry = f'[[model.merge_adapters]]\npath = "{files["low"]}"\n'
    job.write_text(JOB.format(more="", images=images, root=tmp_path) + entry)
    assert main(["check", str(job)]) == 2
    assert "model.merge_adapters[0].expert = ''" in capsys.readouterr().err
    job.write_text(job.read_text() + 'expert = "low"\n')
    assert main(["check", str(job)]) == 0, capsys.readouterr().err
    assert main(["check", str(job), "--set", 'model.expert="high"']) == 2
    assert "trains the 'high' expert alone" in capsys.readouterr().err


def test_check_refuses_what_a_run_of_both_experts_does_not_take(tmp_path, capsys):
    """Exit 2 naming the key and what to set (or one expert a run); the plain job passes, sharded
    or compiled too, and its run is named after the job; model.expert_switch_every without "both" is
    refused."""
    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (64, 64)).save(images / "a.png")
    job = tmp_path / "a14b.toml"
    job.write_text(JOB.format(more="expert_switch_every = 10", images=images, root=tmp_path))
    assert load_job(job).train.name == "a14b" and load_job(job).model.expert_switch_every == 10
    assert main(["check", str(job)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    for setting, named in REFUSED:
        sets = [a for one in setting.split() for a in ("--set", one)]
        assert main(["check", str(job), *sets]) == 2, setting
        err = capsys.readouterr().err
        assert named in err and 'model.expert = "both"' in err, err
        assert 'model.expert = "high", then "low"' in err, err
    assert main(["check", str(job), "--set", 'model.expert="low"']) == 2
    assert "model.expert_switch_every = 10 is for a run" in capsys.readouterr().err
    swap = ["--set", "train.gradient_checkpointing=true", "--set", "memory.blocks_to_swap="]
    assert main(["check", str(job), *swap[:-1], swap[-1] + "2"]) == 0  # of each expert's 3
    capsys.readouterr()
    assert main(["check", str(job), *swap[:-1], swap[-1] + "3"]) == 2
    assert "has 3 blocks (each expert)" in capsys.readouterr().err
    # scaling.strategy = "fsdp" shards both experts; "auto" (the default) weighs sharding them
    # where a replica does not fit the worker's memory, and says what neither way fits
    assert main(["check", str(job), "--set", 'scaling.strategy="fsdp"']) == 0
    assert main(["check", str(job), "--set", "train.compile=true"]) == 0
    capsys.readouterr()
    small = ["--set", "preprocess.resolution=64", "--set", "preprocess.bucket_step=32"]
    assert main(["check", str(job), *small, "--set", 'scaling.worker_memory="100MiB"']) == 2
    err = capsys.readouterr().err
    assert "a replica needs" in err and "sharded over 4 workers" in err, err


@pytest.mark.parametrize("turn", [0, 1])
def test_block_swap_streams_each_experts_last_blocks_and_changes_no_gradient(turn):
    """``memory.blocks_to_swap = 2`` streams the last 2 blocks of each expert; a step of one
    expert uploads only its own (never the idle expert's), and gives the loss and LoRA
    gradients of the resident model."""
    from test_lowvram import LORA, _batch, _Slice, _train

    from raytuner import placement
    from raytuner.config import MemoryConfig
    from raytuner.train.model import trainable_model
    from raytuner.train.step import forward_backward

    family = get_family("wan22", mixture.BOTH)
    model = ModelConfig(family="wan22", expert=mixture.BOTH)

    def step(memory: MemoryConfig):
        torch.manual_seed(0)
        trained = trainable_model(model, _train(), LORA, family, torch.device("cpu"), memory)
        trained.denoiser.activate(turn)
        loss_fn = family.loss(trained.source, _objective())
        tensors = _batch("wan22")
        gens = [torch.Generator().manual_seed(s) for s in (3, 4)]
        tensors = tensors | loss_fn.draw_of(turn)(tuple(tensors["latent"].shape), gens)
        batch = _Slice(tensors, [3, 4])
        loss = forward_backward(trained.denoiser, loss_fn, batch, torch.device("cpu"), 0, 0.5)
        named = zip(trained.weights.names, trained.weights.params, strict=True)
        return loss, {n: p.grad.clone() for n, p in named if p.grad is not None}, trained

    loss0, grads0, plain = step(MemoryConfig())
    sizes = [len(g) for g in placement.block_groups(plain.denoiser, family)]
    assert sizes == [3, 3]
    loss, grads, trained = step(MemoryConfig(blocks_to_swap=2, swap_ring=1))
    streamer = trained.placement.streamer
    assert sorted(streamer.units) == [1, 2, 4, 5]  # the last 2 of each expert's 3
    # its own 2 through a ring of one: each for forward, the first again for the recompute
    assert streamer.uploads == 3 and streamer.peak_resident == 1
    active = {3 * turn + 1, 3 * turn + 2}
    assert set(streamer.resident) <= active
    torch.testing.assert_close(loss, loss0, rtol=0, atol=0)
    assert grads.keys() == grads0.keys() and grads0  # the active expert's alone
    assert {n.split(".")[0] for n in grads} == {family.turns[turn].part}
    for key in grads0:
        torch.testing.assert_close(grads[key], grads0[key], rtol=1e-6, atol=1e-7, msg=key)
    trained.placement.check()


def test_plan_counts_both_experts_and_offers_only_what_the_run_takes(tmp_path):
    """The worker holds both experts (twice one expert's parameters, trained parameters and
    weight bytes); what does not fit a replica (ddp) is offered block swap (of each expert) or
    sharding, and ``scaling.strategy = "auto"`` shards it."""
    import raytuner

    images = tmp_path / "images"
    images.mkdir()
    job = tmp_path / "a14b.toml"
    job.write_text(JOB.format(more="", images=images, root=tmp_path))
    small = ["preprocess.resolution=64", "preprocess.bucket_step=32"]
    small += ["train.gradient_checkpointing=true", "train.micro_batch_size=1"]
    both = raytuner.plan(load_job(job, small), "80GiB")
    one = raytuner.plan(load_job(job, [*small, 'model.expert="high"']), "80GiB")
    assert both["denoiser_params"] == 2 * one["denoiser_params"]
    assert both["trainable_params"] == 2 * one["trainable_params"]
    assert both["weights_bytes"] > 1.9 * one["weights_bytes"]
    # between the peak and the peak with 2 of each expert's 3 blocks streamed (2 resident)
    usable = both["peak_bytes"] - both["worker"]["block_bytes"][0]
    memory = f"{usable / 0.95 / 2**20:.4f}MiB"
    tight = raytuner.plan(load_job(job, [*small, 'scaling.strategy="ddp"']), memory)
    offered = [s["set"] for s in tight["suggestions"]]
    assert not tight["fits"] and "memory.blocks_to_swap = 2" in offered, offered
    assert 'scaling.strategy = "fsdp", scaling.workers = 2 (or more)' in offered, offered
    # "auto" (the default) shards both experts there instead
    auto = raytuner.plan(load_job(job, small), memory)
    assert auto["fits"] and auto["strategy"] == "fsdp", auto["strategy_choice"]
    assert auto["sharded"]["by_workers"][0]["workers"] == 2
