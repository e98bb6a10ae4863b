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
    drafter = Drafter(tokens, k=16)
    drafter.length = k
    assert drafter.draft(16) == draft


def test_an_index_grown_token_by_token_drafts_as_one_built_at_once():
    tokens = [1, 2, 3, 4, 2, 3, 9, 1, 2, 3, 4, 5, 2, 3, 4, 1, 2, 3]
    grown = NgramIndex(tokens[:3])
    for i in range(3, len(tokens)):
        grown.extend(tokens[i : i + 1])
        assert grown.find() == NgramIndex(tokens[: i + 1]).find()


@pytest.mark.parametrize("steps", [(1, 4, 2, 7), (9,), (2, 2, 2, 2, 2)])
def test_tokens_appended_between_lookups_are_all_indexed(steps):
    # The index catches up at a lookup: tokens appended since, several at once, count
    # as if each had been looked up after.
    tokens = [1, 2, 3, 4, 2, 3, 9, 1, 2, 3, 4, 5, 2, 3, 4, 1, 2, 3, 9, 1]
    lazy, every = NgramIndex(tokens[:2]), NgramIndex(tokens[:2])
    at = 2
    for step in steps:
        for token in tokens[at : at + step]:
            every.extend([token])
            every.find()
        lazy.extend(tokens[at : at + step])
        at += step
        assert lazy.find() == every.find()


def test_a_drafter_drafts_more_while_its_drafts_are_taken_whole():
    drafter = Drafter((1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3), k=8)
    assert drafter.draft(10) == (4, 5)  # the first draft is short
    assert drafter.took(2, [4, 5, 6]) == 2  # taken whole, and one more
    assert drafter.length == 4 and drafter.draft(10) == (7, 8, 9, 1)
    drafter.took(4, [7, 8, 9, 1, 2])
    assert drafter.length == 8
    assert drafter.draft(3) == (3, 4, 5)  # no more than the room
    assert drafter.took(3, [3, 9]) == 1  # the second differed: as many again (the copy goes on)
    assert drafter.length == 8
    assert drafter.draft(10) == (5, 6, 7, 8, 9, 1, 2, 3)  # past the changed token
    assert drafter.took(8, [40]) == 0  # none taken: back to short drafts
    assert drafter.length == 2
    drafter.took(0, [9])  # a step without a draft changes nothing
    assert drafter.length == 2 and drafter.ngrams.tokens[-3:] == [9, 40, 9]


def test_after_a_changed_token_the_draft_goes_on_from_its_source():
    # the prompt's 1..12, then the output copies 1, 2, 3, 4, changes 5 into 50, copies on
    drafter = Drafter(tuple(range(1, 13)) + (1, 2, 3), k=16)
    assert drafter.draft(16) == (4, 5)
    drafter.took(2, [4, 50])  # the 4 taken, the 5 changed: (3, 4, 50) occurred nowhere
    assert drafter.ngrams.find() is None
    assert drafter.draft(16) == (6, 7)  # the source goes on past the changed token
    drafter.took(2, [6, 7, 8])
    assert drafter.draft(16)[:2] == (9, 10)


def test_a_followed_source_keeps_its_place_over_a_later_occurrence():
    prompt = (10, 11, 12, 1, 2, 3, 4, 5, 20, 21, 12, 1, 2, 3, 6, 7, 30, 10, 11, 12)
    drafter = Drafter(prompt, k=16)
    assert drafter.draft(16) == (1, 2)  # after (10, 11, 12)
    drafter.took(2, [1, 2, 3])
    later = drafter.ngrams.find()  # (12, 1, 2, 3) last occurred before 6
    assert later is not None and drafter.ngrams.tokens[later] == 6
    assert drafter.draft(16) == (4, 5, 20, 21)  # the copy goes on where it was


def test_a_followed_draft_missed_at_its_first_token_is_followed_once_more():
    prompt = (10, 11, 12, 1, 2, 3, 4, 5, 20, 21, 22, 30, 10, 11, 12)
    drafter = Drafter(prompt, k=16)
    drafter.took(2, [1, 2, 3])
    assert drafter.draft(16) == (4, 5, 20, 21)
    drafter.took(4, [40])  # a changed token: the source goes on past it
    assert drafter.draft(16) == (5, 20)
    drafter.took(2, [41])  # missed again: no longer followed, and nothing to look up
    assert drafter.draft(16) == ()


def test_a_draft_not_taken_at_all_is_not_followed():
    drafter = Drafter(tuple(range(1, 13)) + (1, 2, 3), k=16)
    drafter.took(2, [40])  # its first token differed
    assert drafter.ngrams.find() is None and drafter.draft(16) == ()
