"""Log-probabilities go out with the text their tokens spelled (pure, by table)."""

import pytest

from shardline.api.logprobs import HeldLogprobs, TokenLogprob, completion_logprobs

pytestmark = [pytest.mark.fast, pytest.mark.timeout(30)]


def entry(name: str) -> TokenLogprob:
    return TokenLogprob(name, -1.0, list(name.encode()))


# Each step: a token (name, characters the detokenizer gave for it), then the characters of
# text sent after it and whether they end before a stop string; the names sent with them.
CASES = {
    "plain text goes with its token": [(("Hi", 2), 2, False, ["Hi"]), ((" there", 6), 6, False, [" there"])],
    "a split character's first token waits for the token that completes it": [
        (("<e2>", 0), 0, False, []),
        (("<80><99>", 1), 1, False, ["<e2>", "<80><99>"]),
    ],
    "text held for a possible stop string holds its tokens": [
        (("Hi", 2), 2, False, ["Hi"]),
        (("\n", 1), 0, False, []),
        (("x", 1), 2, False, ["\n", "x"]),
    ],
    "a stop string's tokens are dropped": [
        (("Hi", 2), 2, False, ["Hi"]),
        (("EN", 2), 0, False, []),
        (("D", 1), 0, True, []),
    ],
    "a token spelling text before the stop and the stop's start is dropped": [
        (("Hi", 2), 2, False, ["Hi"]),
        ((".E", 2), 1, False, []),
        (("ND", 2), 0, True, []),
    ],
    "a stop string inside one token drops it": [(("a.END", 5), 2, True, [])],
    "a split character's tokens before a stop string go": [
        (("<e2>", 0), 0, False, []),
        (("<80><99>", 1), 0, False, []),
        (("\n", 1), 1, True, ["<e2>", "<80><99>"]),
    ],
}


@pytest.mark.parametrize("steps", CASES.values(), ids=CASES.keys())
def test_held_logprobs_go_out_with_their_text(steps):
    held = HeldLogprobs()
    for (name, chars), sent, stopped, expected in steps:
        held.push(entry(name), chars)
        assert [t.token for t in held.send(sent, stopped)] == expected


def test_offsets_follow_the_text_not_the_pieces():
    """Two tokens of one character both start where it stands; the next starts after it
    (pieces of a split character read as U+FFFD, one character each)."""
    held = HeldLogprobs()
    for name, chars in (("A", 1), ("\ufffd", 0), ("\ufffd", 1), ("B", 1)):
        held.push(entry(name), chars)
    out = held.send(3, False)
    assert [t.offset for t in out] == [0, 1, 1, 2]
    assert completion_logprobs(list(out), 10)["text_offset"] == [10, 11, 11, 12]


def test_flush_sends_tokens_that_never_spelled_text():
    held = HeldLogprobs()
    held.push(entry("A"), 1)
    held.push(entry("<e2>"), 0)
    assert [t.token for t in held.send(1, False)] == ["A"]
    assert [t.token for t in held.flush()] == ["<e2>"]
    assert held.flush() == ()


def test_no_logprobs_asked_still_counts_the_text():
    held = HeldLogprobs()
    held.push(None, 3)
    held.push(entry("x"), 1)
    assert [(t.token, t.offset) for t in held.send(4, False)] == [("x", 3)]
