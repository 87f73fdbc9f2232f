"""Training the semantic adaptive tokens (`python -m sdsat.train`)."""

from .trainer import TrainConfig, train

__all__ = ["TrainConfig", "train"]
