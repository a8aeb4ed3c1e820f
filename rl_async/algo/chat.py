"""Token-in/token-out rendering of multi-turn conversations (SPEC §12).

The tokens the engine sampled are the tokens trained: an assistant turn is never re-tokenized
from its text (a re-tokenization can differ from what was sampled, and then the trainer scores
tokens the policy never produced). What the environment adds is rendered the way the chat
template renders it: the text the template produces for the conversation after the new
messages (ready for the next assistant turn) minus the text it produces before them. Before
that delta comes whatever the template closes an assistant turn with that the engine did not
sample (SmolLM2's "<|im_end|>\\n" after a turn that stopped at "<|im_end|>" adds only "\\n"; a
turn cut by max_new_tokens gets the whole closing). Those tokens are context, never trained.

`digit_tokenizer()` is a real Hugging Face tokenizer over the built-in 16-token vocabulary
(4 specials, 10 digits, "?" and <unk>) with a chat template, so the tiny config-built model
plays multi-turn games through the same code path as a pretrained one.
"""

from __future__ import annotations

from rl_async.algo.environments import EnvironmentFailure

_SENTINEL = "\u2063rl-async-turn\u2063"
_BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]

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


class ChatRenderer:
    """Renders a conversation's prompt and each environment turn to token ids."""

    def __init__(self, tokenizer, stop_token_ids: tuple[int, ...] = ()):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("multi-turn environments need a tokenizer with a chat template "
                             "(model.path's tokenizer_config.json has none)")
        self.tokenizer = tokenizer
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
        conversation = [_BASE[0], {"role": "assistant", "content": _SENTINEL}]
        text = self.text(conversation, generation_prompt=False)
        at = text.rfind(_SENTINEL)
        if at < 0:
            raise ValueError("the chat template drops an assistant turn's content; "
                             "multi-turn rendering needs it")
        # What the template writes after an assistant's content ("</s>", "<|im_end|>\n").
        self.turn_suffix = text[at + len(_SENTINEL):]

    def text(self, messages: list[dict], generation_prompt: bool,
             tools: list[dict] | None = None) -> str:
        # `tools` (OpenAI function schemas) reach the template, which renders them where it
        # supports tools and ignores them otherwise.
        extra = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=generation_prompt,
                                                  **extra)

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The conversation so far, ready for the assistant's first turn."""
        return self.encode(self.text(messages, generation_prompt=True, tools=tools))

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

    def continuation_ids(self, conversation: list[dict], sampled_ids: list[int],
                         new_messages: list[dict], tools: list[dict] | None = None
                         ) -> list[int]:
        """Token ids that follow the sampled turn: the rest of the turn's closing, the new
        messages as the template renders them, and the next turn's generation prompt.
        `conversation` ends with the assistant message of `sampled_ids`."""
        before = self.text(conversation, generation_prompt=False, tools=tools)
        after = self.text(conversation + new_messages, generation_prompt=True, tools=tools)
        if not after.startswith(before):
            # Templates that rewrite history (e.g. drop earlier reasoning once a new user
            # turn arrives): the new messages' rendering after a neutral conversation.
            before = self.text(_BASE, generation_prompt=False)
            after = self.text(_BASE + new_messages, generation_prompt=True)
            if not after.startswith(before):
                raise EnvironmentFailure(
                    "the chat template renders earlier turns differently once new messages "
                    "follow, so an environment turn has no token delta; use a template that "
                    "only appends")
        return self.encode(self.closing(sampled_ids) + after[len(before):])
