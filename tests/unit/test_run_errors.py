"""A failed run's `error` names the real cause: the innermost exception's type and message
(a nested Ray task error's text is a traceback whose cause comes last, and it used to keep
the head of it), the tasks it came through, and no ANSI colour codes."""

from __future__ import annotations

from ray.exceptions import RayTaskError

from launch.run import _cause


def test_the_innermost_cause_is_kept_without_colour_codes():
    inner = RayTaskError("TrainerWorker.train", "Traceback (most recent call last):\n"
                         "  \x1b[36mFile 'x.py'\x1b[39m\n" + "  frame\n" * 400 +
                         "NonFiniteTraining: optimizer step 7: non-finite loss (nan)",
                         RuntimeError("optimizer step 7: non-finite loss (nan)"))
    outer = RayTaskError("ControllerActor.run", "Traceback outer\n\x1b[31m" + str(inner), inner)
    text = _cause(outer)
    assert text.startswith("RuntimeError: optimizer step 7: non-finite loss (nan)")
    assert "raised in TrainerWorker.train, via ControllerActor.run" in text
    assert "\x1b[" not in text and len(text) < 300


def test_a_plain_exception_is_quoted_as_it_is():
    assert _cause(ValueError("bad row")) == "ValueError: bad row"
