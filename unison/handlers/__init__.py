"""Handlers to attach to an engine's events."""

from unison.handlers.epoch_average import EpochAverage
from unison.handlers.progress import ProgressBar
from unison.handlers.sampler_epoch import SetSamplerEpoch

__all__ = ["EpochAverage", "ProgressBar", "SetSamplerEpoch"]
