"""raytuner: fine-tune diffusion image models on a Ray cluster.

The public API (``raytuner.api``): ``load_job``, ``check``, ``preprocess``, ``train``, ``run``,
``sample``, ``plan``; loaded on first use, so ``import raytuner`` stays cheap.
"""

from raytuner import quiet as _quiet
from raytuner.version import __version__ as __version__

# in every process that imports raytuner (the driver, each Ray worker and actor), before any
# of its libraries: their few warnings that say nothing to a raytuner user (raytuner/quiet.py)
_quiet.install()

__all__ = ["ConfigError", "JobConfig", "check", "load_job", "plan", "preprocess", "run"]
__all__ += ["sample", "train"]


def __getattr__(name: str):
    if name in __all__:
        from raytuner import api

        return getattr(api, name)
    raise AttributeError(f"module 'raytuner' has no attribute {name!r}")
