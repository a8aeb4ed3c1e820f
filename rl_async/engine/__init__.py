"""Engines: the interface shaped after SGLang's server API (SPEC §10), the embedded torch
engine, the SGLang client and launcher, the router, and the synthetic engine with its timing
models.

Imports: `base`, `plan` (a config's experts: plan.moe), `state` (models, the weights codec,
collective groups); never the loop.
"""
