"""Configuration and planning: the typed run config and its TOML loader, the capacity plan
(`rl-async plan`), the checks behind `rl-async validate`, and the dry-run settings.

Imports: `rl_async.base`, `rl_async.algo`, `rl_async.observe`. The plan is computed once
here; every other room reads the resolved numbers.
"""
