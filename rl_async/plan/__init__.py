"""Configuration and planning: the typed run config and its TOML loader, the capacity plan
(`rl-async plan`), the checks behind `rl-async validate`, and the dry-run settings.

Imports: `base`, `algo`. The plan is computed once here; every other room reads the
resolved numbers.
"""
