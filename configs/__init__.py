"""Hydra configs of pyrl (YAML package data), found by `python -m pyrl.ppo` after any install."""
