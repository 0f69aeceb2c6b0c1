"""Hydra configs for lightning-dist-train, shipped inside the wheel (initialize_config_module needs this file)."""
