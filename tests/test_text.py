"""Stop strings and incremental detokenization with the real tokenizer."""

import pytest

from shardline.api.text_stream import StopMatcher
from shardline.models.store import default_model_path
from shardline.models.tokenizer import IncrementalDetokenizer, Tokenizer, text_starts

pytestmark = pytest.mark.timeout(60)


def test_stop_string_split_across_pieces_is_held_back_then_cut():
    m = StopMatcher(["END"])
    assert m.feed("hello E") == ("hello ", False)
    assert m.feed("N") == ("", False)
    assert m.feed("D and more") == ("", True)


def test_text_that_only_looks_like_a_stop_prefix_is_released():
    m = StopMatcher(["END"])
    assert m.feed("E") == ("", False)
    assert m.feed("x") == ("Ex", False)
    assert m.flush() == ""


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(default_model_path())


def test_incremental_detokenizer_matches_whole_decode(tokenizer):
    text = "Déjà vu — naïve café, 東京 and emoji 🙂 at the end."
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.push(i) for i in ids) == tokenizer.decode(ids)


def test_chat_template_opens_the_assistant_turn(tokenizer):
    prompt = tokenizer.render_chat([{"role": "user", "content": "Hi"}])
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token_ids == [2]


def test_text_starts_place_split_characters_where_they_stand(tokenizer):
    """A token that starts a character starts after the text before it; the tokens that
    together spell a split character all start where the first of them does; the last
    token's text ends where the text does (no drift)."""
    text = "a 🙂 b 東京 c"
    ids = tokenizer.encode(text, add_special_tokens=False)
    starts = text_starts(tokenizer, ids)
    assert len(ids) > len(text.split())  # the emoji and the kanji span several tokens
    assert starts == sorted(starts) and starts[0] == 0
    for i, start in enumerate(starts):
        before = tokenizer.decode(ids[:i])
        if "\ufffd" in before:  # token i continues a character: it starts no later than it
            assert start <= len(before.rstrip("\ufffd")), i
        else:
            assert start == len(before), i
    assert starts[-1] + len(tokenizer.decode(ids[-1:])) == len(text)


def test_a_flushed_detokenizer_gives_what_decoding_all_the_ids_gives(tokenizer):
    """An output that ends inside a character keeps the text its last tokens held and
    reads U+FFFD for the character, as decoding every id does."""
    ids = tokenizer.encode("ok 🙂", add_special_tokens=False)
    for cut in range(1, len(ids) + 1):
        detok = IncrementalDetokenizer(tokenizer)
        text = "".join(detok.push(i) for i in ids[:cut]) + detok.flush()
        assert text == tokenizer.decode(ids[:cut]), cut
        assert detok.flush() == ""
