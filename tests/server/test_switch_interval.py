"""The server runs with a short thread switch interval, so that the engine's worker thread is not held
back by a busy event loop for Python's default 5 ms; the interpreter's own setting comes back after."""

import sys

import pytest

from streamsd.server.serve import SWITCH_INTERVAL_S, short_switch_interval


def test_switch_interval_is_short_while_serving_and_restored_after():
    before = sys.getswitchinterval()
    assert before != SWITCH_INTERVAL_S  # the test would prove nothing at the default's own value
    with short_switch_interval():
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
    assert sys.getswitchinterval() == before


def test_switch_interval_is_restored_when_the_server_fails():
    before = sys.getswitchinterval()
    with pytest.raises(RuntimeError), short_switch_interval():
        raise RuntimeError("server stopped")
    assert sys.getswitchinterval() == before
