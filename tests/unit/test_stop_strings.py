"""Stop strings: earliest-completing wins, cut or kept, hold-back, min_tokens."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.engine.client.stop_strings import StopStringMatcher, check_stop_strings


def test_no_match_and_no_new_text() -> None:
    assert check_stop_strings("hello world", 5, ["xyz"], False) is None
    assert check_stop_strings("hello world", 0, ["world"], False) is None
    assert check_stop_strings("hello world", 5, [], False) is None


def test_excluded_stop_is_cut_at_its_start_included_at_its_end() -> None:
    assert check_stop_strings("hello world!!", 8, ["wor"], False) == ("wor", 6)
    assert check_stop_strings("hello world!!", 8, ["wor"], True) == ("wor", 9)
    # Included and ending the text: nothing to cut.
    assert check_stop_strings("hello world", 5, ["world"], True) == ("world", -1)


def test_earliest_completing_stop_wins_over_list_order() -> None:
    # "cd" completes at 4, "bcde" at 5, although "bcde" starts earlier and is listed first.
    assert check_stop_strings("abcdef", 6, ["bcde", "cd"], False) == ("cd", 2)


def test_ties_go_to_list_order() -> None:
    # "de" and "cde" both complete at 5.
    assert check_stop_strings("abcdef", 6, ["de", "cde"], False) == ("de", 3)
    assert check_stop_strings("abcdef", 6, ["cde", "de"], False) == ("cde", 2)


def test_only_new_text_is_searched_but_a_straddling_stop_is_found() -> None:
    # "stop" lies wholly in old text: not found again.
    assert check_stop_strings("a stop here", 4, ["stop"], False) is None
    # "stop" straddles the old/new boundary ("st" old, "op" new).
    assert check_stop_strings("a stop", 2, ["stop"], False) == ("stop", 2)


def feed(matcher: StopStringMatcher, pieces: list[str]) -> list[str]:
    deltas = []
    for i, piece in enumerate(pieces, start=1):
        if matcher.append(piece, i) is not None:
            break
        deltas.append(matcher.next_delta(finished=False))
    deltas.append(matcher.next_delta(finished=True))
    return deltas


def test_partial_match_is_held_back_and_released_at_finish() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.hold_back == 3
    deltas = feed(matcher, ["ab", "cS", "TO", "x"])
    # The last 3 characters stay back, so "S" waits until "STO" grows into "STOx", not "STOP";
    # at finish the rest comes out.
    assert deltas == ["", "a", "bc", "S", "TOx"]
    assert "".join(deltas) == "abcSTOx"


def test_matched_stop_never_appears_in_deltas() -> None:
    matcher = StopStringMatcher(["STOP", "!"])
    deltas = feed(matcher, ["hel", "lo S", "TOP and more"])
    assert matcher.matched == "STOP"
    assert "".join(deltas) == "hello "
    assert matcher.text == "hello "


def test_included_stop_is_kept_and_nothing_is_held_back() -> None:
    matcher = StopStringMatcher(["STOP"], include_in_output=True)
    assert matcher.hold_back == 0
    deltas = feed(matcher, ["hello S", "TOP and more"])
    assert deltas == ["hello S", "TOP"]


def test_stop_strings_within_min_tokens_are_ignored() -> None:
    matcher = StopStringMatcher(["x"], min_tokens=2)
    assert matcher.append("axb", 1) is None
    assert matcher.append("x", 2) is None
    assert matcher.append("cxd", 3) == "x"
    assert matcher.text == "axbxc"


def test_stop_straddling_the_min_tokens_boundary_counts() -> None:
    matcher = StopStringMatcher(["ab"], min_tokens=1)
    assert matcher.append("a", 1) is None
    assert matcher.append("b", 2) == "ab"
    assert matcher.text == ""


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abST!", max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=10),
    include=st.booleans(),
)
def test_streamed_deltas_equal_the_text_cut_at_the_first_stop(
    text: str, cuts: list[int], include: bool
) -> None:
    stops = ["ST!", "bb"]
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    matcher = StopStringMatcher(stops, include_in_output=include)
    deltas = feed(matcher, pieces)
    ends = [(text.find(s) + len(s), s) for s in stops if s in text]
    if ends:
        end, stop = min(ends)
        expected = text[:end] if include else text[: end - len(stop)]
        assert matcher.matched == stop
    else:
        expected = text
    assert "".join(deltas) == expected
    if not include:
        assert all(not any(s in d for s in stops) for d in deltas)
