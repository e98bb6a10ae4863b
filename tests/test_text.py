"""Stop strings and incremental detokenization with the real tokenizer."""

import pytest

from shardline.api.generation import StopMatcher
from shardline.models.store import default_model_path
from shardline.models.tokenizer import IncrementalDetokenizer, Tokenizer

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
