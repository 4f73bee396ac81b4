"""ep_plugin: expert-parallel dispatch and combine for Mixture-of-Experts models.

`ep_plugin.Buffer` is a drop-in for DeepEP V1's `deep_ep.Buffer`; `ep_plugin.load_config` reads the
YAML configuration described in README.md.
"""
from .buffer import Buffer
from .config import ConfigError, EpConfig, load_config
from .errors import EpCommError, EpTimeoutError
from .event import EventHandle, EventOverlap
from .tuning import Config

__all__ = ["Buffer", "Config", "ConfigError", "EpCommError", "EpConfig", "EpTimeoutError", "EventHandle", "EventOverlap",
           "load_config"]
__version__ = "0.1.0"
