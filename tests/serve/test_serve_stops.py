"""Stop strings on a growing text (``minicb.entrypoints.serve.stops.StopMatcher``): whatever the chunking, the
text sent ends right before the first stop string to appear (at its earliest occurrence in the text
so far), and no stop string is ever sent, not even its first characters ahead of time."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hypothesis_profiles import examples
from minicb.entrypoints.serve.stops import StopMatcher


def run(stops, chunks) -> tuple[str, bool, list[str]]:
    m = StopMatcher(tuple(stops))
    sent = []
    for c in chunks:
        sent.append(m.push(c))
        if m.stopped:
            break
    if not m.stopped:
        sent.append(m.flush())
    return "".join(sent), m.stopped, sent


def expected(stops, chunks) -> tuple[str, bool]:
    """The oracle, with plain ``str.find``: the text so far after each chunk; the first of these that
    contains a stop string is cut before the earliest occurrence in it."""
    text = ""
    for c in chunks:
        text += c
        hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
        if hits:
            return text[:min(hits)], True
    return text, False


def test_the_docstring_example():
    text, stopped, sent = run(["END"], ["The", " E", "N", "D!", " more"])
    assert (text, stopped) == ("The ", True)
    assert sent == ["The", " ", "", ""]            # "E" and "EN" held back, never sent


def test_text_that_only_looks_like_a_stop_is_released():
    m = StopMatcher(("END",))
    assert m.push("EN") == ""                       # could still become "END"
    assert m.push("X") == "ENX"                     # it did not: released with the new text
    assert m.push("E") == ""
    assert m.flush() == "E"                         # the request ended: held text is text after all


def test_the_first_stop_to_complete_ends_the_text_at_its_earliest_occurrence():
    assert run(["bcd", "c"], ["ab", "cd"])[:2] == ("a", True)     # both complete with "cd": earliest wins
    assert run(["bcd", "c"], ["abc", "d"])[:2] == ("ab", True)    # "c" completes first: the text ends
    assert run(["abc", "bd"], ["a", "b", "d"])[:2] == ("a", True)


def test_no_stops_and_empty_stops_pass_everything_through():
    assert run([], ["a", "b"])[:2] == ("ab", False)
    assert run([""], ["a", "b"])[:2] == ("ab", False)


def test_nothing_after_a_match():
    m = StopMatcher(("x",))
    assert m.push("axb") == "a" and m.stopped
    assert m.push("more") == "" and m.flush() == ""


@settings(max_examples=examples(200), deadline=None)
@given(stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), max_size=3),
       chunks=st.lists(st.text(alphabet="abc\n", max_size=5), max_size=12))
def test_any_chunking_gives_the_text_before_the_first_stop(stops, chunks):
    text, stopped, sent = run(stops, chunks)
    assert (text, stopped) == expected(stops, chunks)
    for s in stops:          # no prefix of the sent text ever showed a stop string
        assert s not in text


@settings(max_examples=300, deadline=None)
@given(stops=st.lists(st.text(alphabet="ab", min_size=1, max_size=10), min_size=1, max_size=4),
       chunks=st.lists(st.text(alphabet="ab", max_size=6), max_size=16))
def test_self_overlapping_stops_on_a_two_letter_alphabet(stops, chunks):
    """Stops like "aab" on "aaab" are where a matcher must fall back on its failure table."""
    text, stopped, sent = run(stops, chunks)
    assert (text, stopped) == expected(stops, chunks)


def test_long_stop_strings_cost_memory_in_their_length_not_its_square():
    """4 stop strings of 30,000 characters (a 120 KB request): the old matcher made every prefix (1.8
    billion characters). Now the peak is a few bytes per stop character, and the held text never
    outgrows the longest stop string."""
    import tracemalloc

    stops = tuple(("ab" * 15_000)[:-1] + c for c in "abcd")
    tracemalloc.start()
    try:
        m = StopMatcher(stops)
        for _ in range(200):
            m.push("ab" * 50)
            assert len(m.held) < 30_000
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert not m.stopped
    assert peak < 100 * sum(map(len, stops)), peak          # linear: 12 MB, against gigabytes before
    assert m.push("ab" * 5_000) == "" and m.stopped      # 30,000 characters: "abab...ab" appeared at 0


def run_with(stops, chunks, include: bool, first_allowed: int) -> tuple[str, bool]:
    m = StopMatcher(tuple(stops), include)
    sent = []
    for j, c in enumerate(chunks):
        sent.append(m.push(c, can_stop=j >= first_allowed))
        if m.stopped:
            return "".join(sent), True
    return "".join(sent) + m.flush(), False


def expected_with(stops, chunks, include: bool, first_allowed: int) -> tuple[str, bool]:
    """The oracle with ``str.find``: from chunk ``first_allowed`` on (vLLM's min_tokens), the earliest
    stop occurrence that ends in the chunk's new text; cut before it, or after it with ``include``."""
    text = ""
    for j, c in enumerate(chunks):
        before, text = len(text), text + c
        if j < first_allowed:
            continue
        spans = []
        for s in (s for s in stops if s):
            i = text.find(s, max(0, before - len(s) + 1))
            if i >= 0:
                spans.append((i, i + len(s)))
        if spans:
            start, end = min(spans)
            return text[:end if include else start], True
    return text, False


@settings(max_examples=examples(300), deadline=None)
@given(stops=st.lists(st.text(alphabet="ab", min_size=1, max_size=5), min_size=1, max_size=3),
       chunks=st.lists(st.text(alphabet="ab", max_size=4), max_size=12), include=st.booleans(),
       first_allowed=st.integers(0, 6))
def test_include_stop_str_and_min_tokens_against_find(stops, chunks, include, first_allowed):
    assert run_with(stops, chunks, include, first_allowed) == expected_with(stops, chunks, include,
                                                                            first_allowed)


def test_include_keeps_the_stop_string_and_a_stop_before_min_tokens_is_passed_over():
    assert run_with(["END"], ["The", " E", "N", "D!"], True, 0) == ("The END", True)
    assert run_with(["ab"], ["xab", "yab", "z"], False, 1) == ("xaby", True)     # the first "ab" is early
    assert run_with(["aa"], ["a", "a", "a"], False, 2) == ("a", True)         # "aa" again, ending later
