"""Prompt-lookup drafts (:mod:`shardline.runner.speculation`), by table."""

import pytest

from shardline.runner.speculation import Drafter, NgramIndex

pytestmark = [pytest.mark.fast, pytest.mark.timeout(10)]


@pytest.mark.parametrize(
    "tokens, k, draft",
    [
        ((1, 2, 3, 4, 1, 2, 3), 3, (4, 1, 2)),  # what followed (1, 2, 3) before
        ((1, 2, 3, 4, 1, 2, 3), 9, (4, 1, 2, 3)),  # up to the end
        ((7, 1, 2, 3, 9, 5, 1, 2, 3, 8, 7, 1, 2, 3), 1, (9,)),  # the longest suffix found wins
        ((1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3), 1, (5,)),  # its latest occurrence
        ((1, 2, 3), 2, ()),  # nothing repeats
        ((1, 2, 3, 1, 2, 3), 0, ()),
        ((5, 1, 9, 5, 1), 2, ()),  # two tokens are too short a suffix
        ((3, 3, 3, 3), 2, (3,)),  # a run guesses itself, up to the end
    ],
)
def test_a_draft_is_what_followed_the_last_tokens_before(tokens, k, draft):
    assert NgramIndex(tokens).draft(k) == draft


def test_an_index_grown_token_by_token_drafts_as_one_built_at_once():
    tokens = [1, 2, 3, 4, 2, 3, 9, 1, 2, 3, 4, 5, 2, 3, 4, 1, 2, 3]
    grown = NgramIndex(tokens[:3])
    for i in range(3, len(tokens)):
        grown.extend(tokens[i : i + 1])
        assert grown.draft(3) == NgramIndex(tokens[: i + 1]).draft(3)


def test_a_drafter_drafts_more_while_its_drafts_are_taken_whole():
    drafter = Drafter((1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3), k=8)
    assert drafter.draft(10) == (4, 5)  # the first draft is short
    drafter.took(2, [4, 5, 6])  # taken whole, and one more
    assert drafter.length == 4 and drafter.draft(10) == (7, 8, 9, 1)
    drafter.took(4, [7, 8, 9, 1, 2])
    assert drafter.length == 8
    assert drafter.draft(3) == (3, 4, 5)  # no more than the room
    drafter.took(8, [3, 9])  # the second differed: back to short drafts
    assert drafter.length == 2
    drafter.took(0, [9])  # a step without a draft changes nothing
    assert drafter.length == 2 and drafter.ngrams.tokens[-3:] == [3, 9, 9]
