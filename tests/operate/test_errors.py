"""A failure inside Ray shows its real cause on the user's terminal: the one-line error names
the exception raised in the task, the Ray Data operator or the training worker, not Ray's
wrapper. Real Ray failures on the session's local Ray."""

from __future__ import annotations

import pytest

from raytuner.errors import root_line

SHAPE = (
    "Given groups=1, weight of size [128, 4, 3, 3], expected input[8, 3, 64, 64] to have 4 channels"
)


def test_a_ray_data_operator_failure_names_the_exception_inside(ray_local):
    def _vae_like_failure(batch):  # nested: pickled by value for Ray's workers
        raise RuntimeError(SHAPE)

    with pytest.raises(Exception) as caught:
        ray_local.data.range(4).map_batches(_vae_like_failure).materialize()
    assert "UserCodeException" in type(caught.value).__name__  # what Ray raises
    assert root_line(caught.value) == f"RuntimeError: {SHAPE}"


def test_a_task_failure_names_the_exception_inside(ray_local):
    @ray_local.remote
    def encode():
        raise ValueError("caption file is not UTF-8")

    with pytest.raises(Exception) as caught:
        ray_local.get(encode.remote())
    assert root_line(caught.value) == "ValueError: caption file is not UTF-8"


def test_a_plain_error_keeps_its_first_line():
    try:
        try:
            raise KeyError("latent")
        except KeyError as inner:
            raise RuntimeError("no readable checkpoint\nmore detail") from inner
    except RuntimeError as e:
        assert root_line(e) == "KeyError: 'latent'"
    assert root_line(FileNotFoundError("no committed cache at /x")) == (
        "FileNotFoundError: no committed cache at /x"
    )
