"""How a rank's error reads to its peers (comm/errors.py::error_text): any exception gives a
bounded text, so that the rank always publishes it and the store takes it."""

from __future__ import annotations

from dep_ep.comm.errors import ERROR_TEXT_CHARS, error_text


class Unprintable(Exception):
    def __str__(self):
        raise ValueError("no text")


def test_an_error_text_is_type_and_message():
    assert error_text(KeyError("id 7")) == "KeyError: 'id 7'"
    assert error_text(RuntimeError()) == "RuntimeError: "


def test_an_unprintable_error_still_has_a_text():
    text = error_text(Unprintable())
    assert text == "Unprintable: (its message could not be read: str() raised ValueError)"


def test_a_long_error_text_is_cut_and_says_so():
    text = error_text(RuntimeError("x" * (3 * ERROR_TEXT_CHARS)))
    cut = len("RuntimeError: ") + 3 * ERROR_TEXT_CHARS - ERROR_TEXT_CHARS
    assert text.endswith(f" ... ({cut} more characters)"), text[-60:]
    assert len(text) < ERROR_TEXT_CHARS + 40
    assert error_text(RuntimeError("x" * 100)) == "RuntimeError: " + "x" * 100
