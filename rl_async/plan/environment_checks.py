"""`validate`'s checks of a multi-turn environment run that need more than the config: the
trajectory's length against the model, and the chat template's multi-turn rendering.

- `rollout.max_trajectory_tokens` must be set (every turn's request is the whole trajectory so
  far: without a bound a trajectory grows until the engine refuses it and its group fails)
  and must fit the model's context (max_position_embeddings).
- The chat template (the model's, or task.chat_template with task.chat_template_kwargs) is
  probed as the run will use it (rl_async.algo.chat.template_problems): no stable delta for a
  user follow-up, or a turn terminator that is not a stop token, is an error before the run,
  never a run of failed groups; a template that cannot render tool messages is a warning.
"""

from __future__ import annotations

import json
from pathlib import Path

from rl_async.algo.tasks import ENV_TASKS
from rl_async.plan.capacity import Warning_


def context_length(cfg) -> int | None:
    """The model's max_position_embeddings, where its config says."""
    m = cfg.model
    if m.hf_config is not None:
        value = dict(m.hf_config).get("max_position_embeddings")
    else:
        path = Path(m.path).expanduser() / "config.json" if m.path else None
        if path is None or not path.is_file():
            return None
        raw = json.loads(path.read_text())
        value = raw.get("max_position_embeddings",
                        (raw.get("text_config") or {}).get("max_position_embeddings"))
    return int(value) if isinstance(value, int) else None


def trajectory_errors(cfg) -> list[str]:
    if cfg.task.name not in ENV_TASKS:
        return []
    budget = cfg.rollout.max_trajectory_tokens
    if budget is None:
        context = context_length(cfg)
        return [f"task.name = {cfg.task.name!r} needs rollout.max_trajectory_tokens (prompt + "
                f"every turn, environment tokens included): each turn sends the whole "
                f"trajectory so far, so an unbounded one grows until the engine refuses it; set "
                f"it{f' (at most the context length, {context})' if context else ''}"]
    context = context_length(cfg)
    if context is not None and budget > context:
        return [f"rollout.max_trajectory_tokens = {budget} exceeds the model's context length "
                f"(max_position_embeddings = {context}); lower it"]
    return []


def template_report(cfg) -> tuple[list[str], list[Warning_]]:
    """(errors, warnings) of the chat template the run's environment turns render with."""
    if cfg.task.name not in ENV_TASKS:
        return [], []
    from rl_async.algo.chat import run_renderer, template_problems

    try:
        renderer = run_renderer(cfg)
    except (ValueError, OSError) as exc:
        return [str(exc)], []
    errors, warnings = template_problems(renderer)
    return errors, [Warning_("CHAT_TEMPLATE", w) for w in warnings]
