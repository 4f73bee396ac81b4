"""Framework integrations shipped as `ep_plugin.integrations.*` (source tree: integrations/)."""
