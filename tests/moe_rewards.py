"""A reward with a spread for any model (tests/ray/test_moe_run.py): a random model over a
real vocabulary never answers right, so the task's own verifier gives every group 0 and
nothing moves. The first response token's parity is random, so groups carry a signal."""


def first_token_parity(sample) -> float:
    return float(sample.response_ids[0] % 2) if sample.response_ids else 0.0
