"""raytuner: fine-tune diffusion image models on a Ray cluster."""

__version__ = "0.1.0"
