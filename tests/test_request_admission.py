"""A request's admission, decided once from the table (:func:`shardline.node.admission.admit`):
run on a ready instance (a local one first, one that holds the request's own window, the
wider one to fall back to), wait for one that loads (checked first against the longest
context, the newest), or refuse (404 none placed, 503 all given up); and the API's wording
of a refusal (:mod:`shardline.api.preparation`)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import one_rank_instance

from shardline.api.preparation import tokenize
from shardline.api.text_stream import APIError, GenerationRequest
from shardline.models.store import ModelNotFoundError
from shardline.node.admission import Ready, Refused, Wait, admit, refused
from shardline.node.status import InstanceStatus
from shardline.node.table import Instance

pytestmark = [pytest.mark.fast, pytest.mark.timeout(10)]

READY, LOADING, FAILED = InstanceStatus.READY, InstanceStatus.LOADING, InstanceStatus.FAILED


def instance(instance_id: str, status: InstanceStatus = READY, **fields) -> Instance:
    """An instance with one rank (:func:`conftest.one_rank_instance`)."""
    return one_rank_instance(instance_id, status, **fields)


def table(*instances: Instance) -> dict[str, Instance]:
    return {i.instance_id: i for i in instances}


def test_a_model_none_placed_is_refused_naming_the_models_served():
    t = table(instance("o1", model="other"), instance("o2", model="other"), instance("x", LOADING, model="third"))
    assert admit(t, "m", "a") == Refused("m", (), ("other",))
    assert admit({}, "m", "a") == Refused("m", (), ())


@pytest.mark.parametrize("status", [LOADING, FAILED])
def test_a_model_loading_or_failed_and_placed_again_is_waited_for(status):
    t = table(instance("i", status), instance("o", model="other"))
    assert admit(t, "m", "a") == Wait(t["i"])


def test_a_model_all_given_up_on_is_refused_naming_each_instance():
    t = table(
        instance("i", FAILED, given_up=True, error="out of memory"),
        instance("o", model="other"),
        instance("j", FAILED, given_up=True),
    )
    assert admit(t, "m", "a") == Refused("m", (t["i"], t["j"]), ("other",))


def test_one_given_up_beside_one_loading_is_waited_for():
    t = table(instance("gone", FAILED, given_up=True, context=4096), instance("i", LOADING, context=64))
    assert admit(t, "m", "a") == Wait(t["i"])


def test_of_several_waited_for_the_longest_context_then_the_newest_is_checked_against():
    t = table(
        instance("short", LOADING, created_at=5.0, context=256),
        instance("old", FAILED, created_at=1.0, context=1024),
        instance("new", LOADING, created_at=2.0, context=1024),
        instance("gone", FAILED, created_at=3.0, context=8192, given_up=True),
    )
    assert admit(t, "m", "a") == Wait(t["new"])


@pytest.mark.parametrize(
    "nodes, chosen",
    [
        ({"remote": ("b", 0.0), "local": ("a", 1.0)}, "local"),  # a rank on this node first
        ({"old": ("a", 0.0), "new": ("a", 1.0)}, "old"),  # then the oldest
        ({"old": ("b", 0.0), "new": ("b", 1.0)}, "old"),
    ],
)
def test_a_ready_instance_with_a_rank_here_is_preferred_then_the_oldest(nodes, chosen):
    t = table(*(instance(i, created_at=at, node=node) for i, (node, at) in nodes.items()))
    assert admit(t, "m", "a") == Ready(t[chosen])


def test_a_ready_instance_wins_over_loading_ones_of_longer_context():
    t = table(instance("loading", LOADING, context=8192), instance("ready", node="b", context=64))
    assert admit(t, "m", "a") == Ready(t["ready"])


@pytest.mark.parametrize("new_status, chosen", [(LOADING, "old"), (READY, "new"), (FAILED, "old")])
def test_an_instance_a_ready_one_stands_in_for_is_skipped(new_status, chosen):
    t = table(instance("old", created_at=0.0), instance("new", new_status, created_at=1.0, replaced=("old",)))
    assert admit(t, "m", "a") == Ready(t[chosen])


@pytest.mark.parametrize(
    "window, chosen, wider",
    [
        (None, "short", "long"),  # the instance's own context
        (64, "short", "long"),  # the local one holds it
        (4096, "long", None),  # only the remote one holds it: that one, and nothing wider
        (2048, "long", None),
        (8192, "short", "long"),  # none holds it: the preferred one
    ],
)
def test_a_window_only_a_wider_instance_holds_goes_there(window, chosen, wider):
    t = table(instance("short", node="a", context=64), instance("long", node="b", context=4096))
    assert admit(t, "m", "a", window) == Ready(t[chosen], t[wider] if wider else None)


@pytest.mark.parametrize(
    "contexts, wider",
    [
        ({"local": 64, "remote": 4096, "mid": 1024}, "remote"),  # the longest
        ({"local": 4096, "remote": 64}, None),  # the local one is the longest
        ({"local": 256, "remote": 256}, None),  # as long: nothing to gain
        ({"local": 256}, None),
    ],
)
def test_the_wider_instance_to_fall_back_to_is_the_longest_where_longer(contexts, wider):
    t = table(*(instance(i, node="a" if i == "local" else "b", context=c) for i, c in contexts.items()))
    assert admit(t, "m", "a") == Ready(t["local"], t[wider] if wider else None)


def test_of_equally_wide_instances_the_first_in_preference_is_the_wider():
    t = table(
        instance("local", node="a", context=64),
        instance("far_old", node="b", created_at=0.0, context=4096),
        instance("far_new", node="c", created_at=1.0, context=4096),
    )
    assert admit(t, "m", "a") == Ready(t["local"], t["far_old"])


def test_a_refusal_after_a_wait_names_what_still_loads():
    t = table(instance("i", LOADING), instance("j", FAILED, given_up=True, error="oom"), instance("o", model="other"))
    assert refused(t, "m") == Refused("m", (t["i"], t["j"]), ("other",))


def refusal(instances: dict[str, Instance]) -> APIError:
    """The error :func:`tokenize` raises for a request for model ``m`` where ``instances``
    hold nothing to run it on, and nothing becomes ready (waited for where one of ``m`` is
    not given up on, its tokenizer not to be had before)."""

    waited: list[str] = []

    async def wait_for_ready(model: str) -> None:
        waited.append(model)

    async def no_tokenizer(model: str) -> Any:
        raise ModelNotFoundError(model)  # not on this node yet: the wait may cure it

    node: Any = SimpleNamespace(
        node_id="a",
        instances=instances,
        router=SimpleNamespace(wait_for_ready=wait_for_ready),
        logistics=SimpleNamespace(tokenizer=no_tokenizer),
    )
    with pytest.raises(APIError) as caught:
        asyncio.run(tokenize(node, GenerationRequest(model="m", prompt=[1, 2])))
    assert waited == (["m"] if any(i.model_id == "m" and not i.given_up for i in instances.values()) else [])
    return caught.value


def test_the_api_words_a_model_none_placed_as_a_404():
    exc = refusal(table(instance("o", model="other")))
    assert (exc.status, exc.code, exc.param) == (404, "model_not_found", "model")
    assert str(exc) == "The model 'm' does not exist or is not loaded (available: other)"
    assert str(refusal({})) == "The model 'm' does not exist or is not loaded (available: none)"


def test_the_api_words_a_model_given_up_on_as_a_503_naming_each_instance():
    exc = refusal(table(instance("i", FAILED, given_up=True, error="oom"), instance("j", FAILED, given_up=True)))
    assert (exc.status, exc.code, exc.param) == (503, "model_not_ready", "model")
    assert str(exc) == "The model 'm' is not ready (instance i failed: oom; instance j failed); retry later"


def test_the_api_words_a_model_not_ready_after_the_wait_as_a_503_naming_what_loads():
    exc = refusal(table(instance("i", LOADING), instance("j", FAILED, given_up=True)))
    assert (exc.status, exc.code) == (503, "model_not_ready")
    assert str(exc) == "The model 'm' is not ready (instance i loading; instance j failed); retry later"
