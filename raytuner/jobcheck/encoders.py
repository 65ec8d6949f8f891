"""The job check's rule about the encoder pool (``raytuner.jobcheck``): an encoder actor whose
text encoder cannot fit the GPUs it is given (``preprocess.gpus_per_actor`` whole GPUs of
``preprocess.gpu_memory_gib`` each, or streamed with ``preprocess.text_encoder_offload``) is
refused before anything starts, naming what would fit (``tools/plan/encoders.py`` sizes it on
the meta device)."""

from __future__ import annotations

from raytuner.config import ConfigError, JobConfig

GiB = 2**30


def encoder_pool(job: JobConfig, family) -> None:
    """A GPU encoder pool (``gpus_per_actor`` > 0) on GPUs of a stated size
    (``gpu_memory_gib`` > 0) whose text encoder does not fit them, as placed."""
    pre = job.preprocess
    if not (pre.gpus_per_actor and pre.gpu_memory_gib):
        return
    from raytuner.tools.plan import encoders

    p = encoders.pool(job, family, int(pre.gpu_memory_gib * GiB))
    if p["fits"]:
        return
    key = (
        "preprocess.text_encoder_offload = true"
        if pre.text_encoder_offload
        else f"preprocess.gpus_per_actor = {pre.gpus_per_actor:g}"
    )
    raise ConfigError(
        f"{key}: an encoder actor's text encoder needs {p['per_gpu_bytes'] / GiB:.1f} GiB a "
        f"GPU {p['where']} (weights {p['weights_bytes'] / GiB:.1f} GiB in {p['dtype']}, the "
        f"VAE {p['vae_bytes'] / GiB:.1f} GiB, activations {p['activations_bytes'] / GiB:.1f} "
        f"GiB for preprocess.batch_size = {p['batch_size']} captions of {p['tokens']} "
        f"tokens), and a GPU of preprocess.gpu_memory_gib = {pre.gpu_memory_gib:g} has "
        f"{p['usable_bytes'] / GiB:.1f} GiB usable: {encoders.advice(p)}"
    )
