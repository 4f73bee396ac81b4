"""ep_plugin: expert-parallel dispatch and combine for Mixture-of-Experts models.

`ep_plugin.Buffer` is a drop-in for DeepEP V1's `deep_ep.Buffer`; `ep_plugin.load_config` reads the
YAML configuration described in README.md.
"""
import torch

from .buffer import Buffer
from .config import ConfigError, EpConfig, load_config
from .errors import EpCommError, EpTimeoutError
from .event import EventHandle, EventOverlap
from .tuning import Config

# DeepEP's dtype for expert ids (`topk_idx`): ep_plugin's kernels take int64 ids.
topk_idx_t = torch.int64

__all__ = ["Buffer", "Config", "ConfigError", "EpConfig", "EventHandle", "EventOverlap", "load_config",
           "topk_idx_t", "EpCommError", "EpTimeoutError"]
__version__ = "0.1.0"
