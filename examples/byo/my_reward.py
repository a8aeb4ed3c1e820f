"""A reward function of your own: 1.0 when the response's last integer is the row's answer."""

import re

from rl_async import Sample

NUMBER = re.compile(r"-?\d+")


def last_number_matches(sample: Sample) -> float:
    # response_text is the decoded response (model.path's tokenizer, special tokens dropped);
    # every JSONL field other than prompt / messages / prompt_ids / id is in metadata.
    numbers = NUMBER.findall(sample.metadata["response_text"])
    return 1.0 if numbers and numbers[-1] == str(sample.metadata["answer"]) else 0.0
