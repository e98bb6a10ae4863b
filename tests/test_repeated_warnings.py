"""A repeating condition warns once a run (pure, with pytest's log capture)."""

import logging

import pytest

from shardline.node.repeated_warnings import RepeatedWarnings

pytestmark = [pytest.mark.fast, pytest.mark.timeout(30)]


def test_a_condition_warns_once_until_it_ends(caplog):
    log = logging.getLogger("test.repeated")
    warnings = RepeatedWarnings(log)
    with caplog.at_level(logging.DEBUG, logger="test.repeated"):
        for _ in range(3):
            warnings.warn("peer a", "could not reach %s", "a")
        warnings.warn("peer b", "could not reach %s", "b")
        warnings.ended("peer a")
        warnings.warn("peer a", "could not reach %s", "a")
    levels = [(r.levelname, r.getMessage().split(" (")[0]) for r in caplog.records]
    assert levels == [
        ("WARNING", "could not reach a"),
        ("DEBUG", "could not reach a"),
        ("DEBUG", "could not reach a"),
        ("WARNING", "could not reach b"),
        ("WARNING", "could not reach a"),
    ]
