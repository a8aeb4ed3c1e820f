"""Token-in/token-out rendering of multi-turn conversations (SPEC §12).

The tokens the engine sampled are the tokens trained: an assistant turn is never re-tokenized
from its text (a re-tokenization can differ from what was sampled, and then the trainer scores
tokens the policy never produced). What the environment adds is rendered the way the chat
template renders it, by a delta that does not depend on how the template renders the turns
before it: the conversation so far is rendered with the last assistant message's content
replaced by a sentinel, once alone and once followed by the new messages (generation prompt
opened); the new tokens are the second text after the sentinel minus the first text after it.
Templates that render an assistant turn by its position (Qwen3 drops or adds an empty
`<think>` block once a user message follows it; DeepSeek-V3 opens tool outputs once per
conversation) change only what comes before the sentinel, which the delta never reads. Before
the delta comes whatever the template closes an assistant turn with that the engine did not
sample (SmolLM2's "<|im_end|>\\n" after a turn that stopped at "<|im_end|>" adds only "\\n";
a turn cut by max_new_tokens gets the whole closing). Those tokens are context, never trained.

A template whose text after the sentinel still changes (or that raises on the conversation)
is tried once more against a neutral conversation (a user message and an assistant reply);
`template_problems` runs the same probes at `validate`, so a template with no stable delta is
refused before the run with the fix (`task.chat_template`, `task.chat_template_kwargs`).

`digit_tokenizer()` is a real Hugging Face tokenizer over the built-in 16-token vocabulary
(4 specials, 10 digits, "?" and <unk>) with a chat template, so the tiny config-built model
plays multi-turn games through the same code path as a pretrained one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rl_async.algo.environments import EnvironmentFailure

_SENTINEL = "\u2063rl-async-turn\u2063"
_NEUTRAL = [{"role": "user", "content": "x"}]
# What every chat template is expected to render (validate's probes): a user follow-up after
# an assistant reply (every multi-turn game), and a tool result after one (tool use).
_PROBE = [{"role": "system", "content": "You are a helpful assistant."},
          {"role": "user", "content": "What is 2 + 2?"},
          {"role": "assistant", "content": "It is 4."}]
PROBE_FOLLOW_UP = [{"role": "user", "content": "And 3 + 3?"}]
PROBE_TOOL = [{"role": "tool", "content": "6", "tool_call_id": "call_0", "name": "add"}]
TEMPLATE_FIX = ("set task.chat_template to a Jinja template file that renders each message "
                "the same wherever it stands (or task.chat_template_kwargs, e.g. "
                "{ enable_thinking = false })")

# Built-in vocabulary (rl_async.algo.tasks: PAD, BOS, EOS, SEP, digits from 4).
DIGIT_VOCAB = {"<pad>": 0, "<s>": 1, "</s>": 2, "|": 3, **{str(d): 4 + d for d in range(10)},
               "?": 14, "<unk>": 15}
# A conversation: BOS, then each user/tool/system message followed by "|", each assistant
# message followed by EOS (the stop token). No generation prompt: the model answers right
# after the "|".
DIGIT_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{{ m['content'] }}{{ eos_token }}{% else %}{{ m['content'] }}|{% endif %}{% endfor %}")


def digit_tokenizer():
    """A character-level tokenizer of the built-in vocabulary with a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(DIGIT_VOCAB, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>", unk_token="<unk>")
    tok.chat_template = DIGIT_CHAT_TEMPLATE
    return tok


def apply_chat_settings(tokenizer, template: str | None, kwargs: dict | None) -> Any:
    """`task.chat_template` (a Jinja file replacing the tokenizer's template) and
    `task.chat_template_kwargs` (passed to every rendering, e.g. enable_thinking) applied to
    the tokenizer, which carries them wherever it renders (prompts, environment turns)."""
    if template is not None:
        file = Path(template).expanduser()
        if not file.is_file():
            raise ValueError(f"task.chat_template = {template!r}: file not found (a Jinja chat "
                             f"template, e.g. one saved from the model's tokenizer_config.json)")
        tokenizer.chat_template = file.read_text()
    tokenizer.rl_async_template_kwargs = dict(kwargs or {})
    return tokenizer


def run_renderer(cfg) -> "ChatRenderer":
    """The run's chat renderer: the checkpoint's tokenizer (or the built-in digit one for a
    config-built model) with the task's chat settings, and the run's stop tokens."""
    from rl_async.algo.stop_ids import stop_token_ids
    from rl_async.algo.tasks import load_tokenizer

    template, kwargs = cfg.task.chat_template, cfg.task.chat_template_kwargs
    if cfg.model.path is not None:
        tokenizer = load_tokenizer(cfg.model, template, kwargs)
    else:
        tokenizer = apply_chat_settings(digit_tokenizer(), template, kwargs)
    if tokenizer is None:
        raise ValueError(f"task.name = {cfg.task.name!r} needs a tokenizer with a chat template; "
                         f"model.path = {cfg.model.path!r} has no tokenizer files")
    return ChatRenderer(tokenizer, stop_token_ids(cfg, tokenizer))


def template_kwargs(tokenizer) -> dict:
    return dict(getattr(tokenizer, "rl_async_template_kwargs", {}) or {})


def template_name(tokenizer) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


class ChatRenderer:
    """Renders a conversation's prompt and each environment turn to token ids."""

    def __init__(self, tokenizer, stop_token_ids: tuple[int, ...] = ()):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("multi-turn environments need a tokenizer with a chat template "
                             "(model.path's tokenizer_config.json has none; or set "
                             "task.chat_template)")
        self.tokenizer = tokenizer
        self.kwargs = template_kwargs(tokenizer)
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
        text = self.text([*_NEUTRAL, {"role": "assistant", "content": _SENTINEL}], False)
        at = text.rfind(_SENTINEL)
        if at < 0:
            raise ValueError(f"the chat template of {template_name(tokenizer)} drops an "
                             f"assistant turn's content; multi-turn rendering needs it")
        # What the template writes after an assistant's content ("</s>", "<|im_end|>\n").
        self.turn_suffix = text[at + len(_SENTINEL):]

    def text(self, messages: list[dict], generation_prompt: bool,
             tools: list[dict] | None = None) -> str:
        # `tools` (OpenAI function schemas) reach the template, which renders them where it
        # supports tools and ignores them otherwise.
        extra = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=generation_prompt,
                                                  **self.kwargs, **extra)

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The conversation so far, ready for the assistant's first turn."""
        try:
            return self.encode(self.text(messages, generation_prompt=True, tools=tools))
        except Exception as exc:  # a template's own refusal (roles, tool ids): the group's
            raise EnvironmentFailure(f"the chat template of {template_name(self.tokenizer)} "
                                     f"cannot render the first conversation: "
                                     f"{type(exc).__name__}: {exc}") from exc

    def assistant_text(self, sampled_ids: list[int]) -> str:
        """The assistant message the environment sees: the sampled tokens decoded, without
        special tokens (the stop token is the template's business)."""
        return self.tokenizer.decode(sampled_ids, skip_special_tokens=True)

    def closing(self, sampled_ids: list[int]) -> str:
        """The part of the template's turn closing the engine did not sample."""
        if sampled_ids and sampled_ids[-1] in self.stop_token_ids:
            stop_text = self.tokenizer.decode([sampled_ids[-1]])
            if self.turn_suffix.startswith(stop_text):
                return self.turn_suffix[len(stop_text):]
        return self.turn_suffix

    def delta_text(self, conversation: list[dict], new_messages: list[dict],
                   tools: list[dict] | None = None) -> str:
        """The template's text for `new_messages` after the assistant turn that ends
        `conversation`, through the next generation prompt (without the turn's closing)."""
        last = {"role": "assistant", "content": _SENTINEL}
        causes = []
        for base, base_tools in ((conversation[:-1], tools), (_NEUTRAL, None)):
            try:
                before = self.text([*base, last], False, base_tools)
                after = self.text([*base, last, *new_messages], True, base_tools)
            except Exception as exc:  # the template refused this conversation
                causes.append(f"{type(exc).__name__}: {exc}")
                continue
            head, tail = _after_sentinel(before), _after_sentinel(after)
            if head is not None and tail is not None and tail.startswith(head):
                return tail[len(head):]
            causes.append("the text after the assistant turn changes once new messages "
                          "follow it")
        roles = [m.get("role") for m in new_messages]
        raise EnvironmentFailure(
            f"the chat template of {template_name(self.tokenizer)} gives no stable token "
            f"delta for new {roles} messages after an assistant turn ({'; '.join(causes)}); "
            f"{TEMPLATE_FIX}")

    def continuation_ids(self, conversation: list[dict], sampled_ids: list[int],
                         new_messages: list[dict], tools: list[dict] | None = None
                         ) -> list[int]:
        """Token ids that follow the sampled turn: the rest of the turn's closing, the new
        messages as the template renders them, and the next turn's generation prompt.
        `conversation` ends with the assistant message of `sampled_ids`."""
        delta = self.delta_text(conversation, new_messages, tools)
        return self.encode(self.closing(sampled_ids) + delta)


def _after_sentinel(text: str) -> str | None:
    at = text.rfind(_SENTINEL)
    return None if at < 0 else text[at + len(_SENTINEL):]


def template_problems(renderer: ChatRenderer) -> tuple[list[str], list[str]]:
    """(errors, warnings) of a chat template for multi-turn use, found before a run:
    a user follow-up with no stable delta is an error (every game sends one); a tool result
    the template cannot render is a warning (only tool environments send them); a template
    whose turn terminator is not a stop token never ends a turn (an error)."""
    errors, warnings = [], []
    name = template_name(renderer.tokenizer)
    try:
        renderer.prompt_ids(_PROBE[:2])
        renderer.delta_text(_PROBE, PROBE_FOLLOW_UP)
    except EnvironmentFailure as exc:
        errors.append(f"{exc} (probe: a user follow-up after an assistant reply)")
    try:
        renderer.delta_text(_PROBE, PROBE_TOOL)
    except EnvironmentFailure as exc:
        warnings.append(f"the chat template of {name} cannot render a tool result after an "
                        f"assistant reply: an environment that sends role 'tool' messages "
                        f"fails its groups ({exc})")
    terminator = renderer.encode(renderer.turn_suffix)[:1]
    if terminator and renderer.stop_token_ids and terminator[0] not in renderer.stop_token_ids:
        errors.append(f"the chat template of {name} ends an assistant turn with token "
                      f"{terminator[0]} ({renderer.tokenizer.decode(terminator)!r}), which is "
                      f"not a stop token {list(renderer.stop_token_ids)}: turns would never "
                      f"stop; add it to rollout.stop_token_ids")
    return errors, warnings
