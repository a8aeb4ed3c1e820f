"""pack() and the shared-prompt layout (train/prefix.plan) are vectorised; these compare them,
field by field, with a plain loop over rows (the layout's definition) on ragged random
items: empty responses, unknown versions, loss masks, anchors, repeated prompts."""

from __future__ import annotations

import random

import pytest
import torch

from rl_async.train.batching import TrainItem, pack


def items_for(seed: int, masks: bool, anchors: bool) -> list[TrainItem]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 50) for _ in range(rng.randint(2, 9))] for _ in range(4)]
    out = []
    for i in range(23):
        n = rng.choice([0, 1, 2, 5, 11])
        out.append(TrainItem(
            list(rng.choice(prompts)), [rng.randrange(50) for _ in range(n)],
            [-rng.random() for _ in range(n)],
            [rng.randrange(4) for _ in range(n)] if rng.random() < 0.8 else [],
            advantage=rng.uniform(-2, 2),
            anchor_logprobs=[-rng.random() for _ in range(n)] if anchors else None,
            loss_mask=([rng.randrange(2) for _ in range(n)] if masks and rng.random() < 0.7
                       else None)))
    return out


def reference_pack(items, pad_id=0):
    """The layout row by row (pack's definition): row i is prompt + response; its response
    token j sits at column len(prompt) - 1 - start + j of the shifted axis."""
    L = max(len(it.prompt_ids) + it.response_len for it in items)
    start = min(len(it.prompt_ids) for it in items) - 1
    B, T = len(items), L - start - 1
    ref = {"ids": torch.full((B, L), pad_id), "attn": torch.zeros((B, L), dtype=torch.long),
           "mask": torch.zeros((B, T), dtype=torch.bool), "behavior": torch.zeros((B, T)),
           "adv": torch.zeros((B, T)), "versions": torch.full((B, T), -1),
           "anchor": torch.zeros((B, T))}
    for i, it in enumerate(items):
        seq = it.prompt_ids + it.response_ids
        ref["ids"][i, :len(seq)] = torch.tensor(seq)
        ref["attn"][i, :len(seq)] = 1
        for j in range(it.response_len):
            c = len(it.prompt_ids) - 1 - start + j
            ref["mask"][i, c] = bool(it.loss_mask[j]) if it.loss_mask else True
            ref["behavior"][i, c] = it.behavior_logprobs[j]
            ref["adv"][i, c] = it.advantage
            if it.token_versions:
                ref["versions"][i, c] = it.token_versions[j]
            if it.anchor_logprobs is not None:
                ref["anchor"][i, c] = it.anchor_logprobs[j]
    return ref, start, T


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("masks, anchors", [(False, False), (True, True)])
def test_pack_matches_the_row_by_row_layout(seed, masks, anchors):
    items = items_for(seed, masks, anchors)
    ref, start, T = reference_pack(items)
    got = pack(items, "cpu", share_prompts=True)
    assert got.start == start and got.targets_BT.shape == (len(items), T)
    assert torch.equal(got.input_ids_BL, ref["ids"])
    assert torch.equal(got.attention_mask_BL, ref["attn"])
    assert torch.equal(got.targets_BT, ref["ids"][:, start + 1:])
    assert torch.equal(got.mask_BT, ref["mask"])
    assert torch.equal(got.behavior_BT, ref["behavior"])
    assert torch.equal(got.advantages_BT, ref["adv"])
    assert torch.equal(got.versions_BT, ref["versions"])
    assert (got.anchor_BT is None) == (not anchors)
    if anchors:
        assert torch.equal(got.anchor_BT, ref["anchor"])
    assert got.spans == [(len(it.prompt_ids) - 1 - start,
                          len(it.prompt_ids) - 1 - start + it.response_len) for it in items]

    # The shared-prompt layout, row by row: fed tokens, their mask columns after the
    # prefix, positions, targets, and each target's column on the shifted axis.
    s = got.shared
    P, R = s.prefix_ids_UP.shape[1], s.ids_BR.shape[1]
    for i, it in enumerate(items):
        fed = [it.prompt_ids[-1]] + it.response_ids[:-1]
        first = len(it.prompt_ids) - 1
        assert s.ids_BR[i, :len(fed)].tolist() == fed and not s.ids_BR[i, len(fed):].any()
        assert s.mask_BK[i, :P].tolist() == [1] * first + [0] * (P - first)
        assert s.mask_BK[i, P:].tolist() == [1] * len(fed) + [0] * (R - len(fed))
        assert s.positions_BR[i].tolist() == list(range(first, first + R))
        n = it.response_len
        assert s.targets_BR[i, :n].tolist() == it.response_ids
        assert s.columns_BR[i, :n].tolist() == list(range(first - start, first - start + n))
        assert (s.columns_BR[i, n:] == T).all()
        assert s.prefix_ids_UP[s.rows_B[i], :first].tolist() == it.prompt_ids[:-1]


def test_a_per_token_list_of_the_wrong_length_names_the_item_and_field():
    items = items_for(0, False, False)
    bad = next(i for i, it in enumerate(items) if it.response_len)
    items[bad].behavior_logprobs = items[bad].behavior_logprobs + [-1.0]
    with pytest.raises(ValueError, match=f"train item {bad}: behavior_logprobs has"):
        pack(items, "cpu")
