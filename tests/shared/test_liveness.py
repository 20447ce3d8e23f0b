"""MissCounter: a verdict only after ``limit`` misses in a row."""

from __future__ import annotations

import pytest

from shared.liveness import MissCounter


def test_a_verdict_comes_at_the_second_miss_in_a_row_and_the_count_restarts():
    misses: MissCounter[str] = MissCounter(limit=2)
    assert misses.miss("gw.a") is False
    assert misses.misses("gw.a") == 1
    assert misses.miss("gw.a") is True
    assert misses.misses("gw.a") == 0  # a new row starts
    assert misses.miss("gw.a") is False


def test_an_answer_between_misses_breaks_the_row():
    misses: MissCounter[str] = MissCounter()
    misses.miss("r1")
    misses.hit("r1")
    assert misses.miss("r1") is False
    assert misses.miss("r1") is True


def test_retain_forgets_keys_no_longer_watched():
    misses: MissCounter[str] = MissCounter(limit=3)
    for key in ("a", "b", "c"):
        misses.miss(key)
    misses.retain(["b", "z"])
    assert (misses.misses("a"), misses.misses("b"), misses.misses("c"), misses.misses("z")) == (0, 1, 0, 0)
    assert misses.miss("a") is False  # forgotten: a new row starts


def test_limit_one_gives_a_verdict_at_every_miss():
    misses: MissCounter[int] = MissCounter(limit=1)
    assert misses.miss(7) is True
    assert misses.miss(7) is True


def test_a_limit_below_one_is_refused():
    with pytest.raises(ValueError, match="limit must be >= 1, got 0"):
        MissCounter(limit=0)
