"""The incremental detokenizer and stop strings (pure, property-tested)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.textstream import TextStream


def run(pieces: list[bytes], stops: tuple[str, ...]) -> tuple[list[str], str, bool, list[int]]:
    stream: TextStream[int] = TextStream(stops)
    outs: list[str] = []
    released: list[int] = []
    for i, piece in enumerate(pieces):
        e = stream.push(piece, i)
        outs.append(e.text)
        released.extend(e.tokens)
        if e.stopped:
            return outs, "".join(outs), True, released
    e = stream.finish()
    outs.append(e.text)
    released.extend(e.tokens)
    return outs, "".join(outs), False, released


def expected(pieces: list[bytes], stops: tuple[str, ...]) -> str:
    """Generation ends at the first token after which a stop string is complete; cut at the earliest one."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text = ""
    for piece in pieces:
        text += decoder.decode(piece)
        found = [text.find(s) for s in stops if s and s in text]
        if found:
            return text[: min(found)]
    return text + decoder.decode(b"", final=True)


def test_multibyte_split_between_tokens() -> None:
    data = "é€😀".encode()
    pieces = [data[:1], data[1:3], data[3:4], data[4:7], data[7:]]
    outs, text, stopped, released = run(pieces, ())
    assert text == "é€😀" and not stopped and released == [0, 1, 2, 3, 4]
    assert "\ufffd" not in "".join(outs)
    assert outs[0] == ""  # half a character is held back


def test_stop_across_tokens_is_not_emitted() -> None:
    outs, text, stopped, released = run([b"Hello ", b"wor", b"ld", b"!"], ("world",))
    assert text == "Hello " and stopped and released == [0]
    assert outs == ["Hello ", "", ""]


def test_partial_stop_prefix_released_when_it_diverges() -> None:
    outs, text, stopped, _ = run([b"ab", b"c", b"x"], ("abd",))
    assert text == "abcx" and not stopped
    assert outs[0] == ""  # "ab" might start "abd"


def test_earliest_stop_wins_and_trailing_partial_char_is_replaced() -> None:
    assert run([b"a1b2"], ("2", "1"))[1] == "a"
    assert run([b"ok", "é".encode()[:1]], ())[1] == "ok\ufffd"


alphabet = st.sampled_from(["a", "b", "\n", "é", "€", "😀", " "])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.text(alphabet, max_size=4), max_size=12),
    st.lists(st.text(alphabet, min_size=1, max_size=3), max_size=3),
    st.data(),
)
def test_emitted_text_equals_decoded_text_cut_at_first_stop(
    words: list[str], stops: list[str], data: st.DataObject
) -> None:
    blob = "".join(words).encode()
    # Cut the bytes anywhere, also inside characters.
    cuts = sorted(data.draw(st.lists(st.integers(0, len(blob)), max_size=8)))
    pieces = [blob[a:b] for a, b in zip([0, *cuts], [*cuts, len(blob)], strict=True)]
    outs, text, stopped, released = run(pieces, tuple(stops))
    assert text == expected(pieces, tuple(stops))
    assert stopped == any(s in blob.decode() for s in stops)  # the whole text is valid UTF-8 here
    for s in stops:
        assert s not in text
    assert released == sorted(released) and len(set(released)) == len(released)
    if not stopped:
        assert released == list(range(len(pieces)))
