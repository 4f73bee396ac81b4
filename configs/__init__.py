"""Shipped YAML configurations, installed as the data package `ep_plugin.configs`."""
import os

CONFIG_DIR = os.path.dirname(os.path.abspath(__file__))


def path(name: str) -> str:
    """Absolute path of a shipped config, e.g. path("default.yaml")."""
    full = os.path.join(CONFIG_DIR, name)
    if not os.path.exists(full):
        available = sorted(f for f in os.listdir(CONFIG_DIR) if f.endswith(".yaml"))
        raise FileNotFoundError(f"no shipped config {name!r}; available: {', '.join(available)}")
    return full
