"""The vectorised refit (``update_many``/``refit_many``) against the scalar one, endpoint by endpoint."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracker.coordinates import (
    NetCoord,
    Observation,
    refit,
    refit_many,
    update,
    update_many,
)

axis = st.floats(-200.0, 200.0, allow_nan=False)
coord = st.builds(
    NetCoord, st.tuples(axis, axis, axis), st.floats(0.05, 40.0), st.sampled_from([0.01, 0.1, 0.4, 0.8, 1.0])
)
# Some observations coincide with the endpoint (zero distance: the hash-chosen direction), some are
# wild (the outlier filter), some out of range (skipped).
rtts = st.one_of(st.floats(0.5, 400.0), st.sampled_from([0.0, 5_000.0, 70_000.0]))
obs = st.builds(Observation, st.sampled_from(["a", "b", "c", "d"]), coord, rtts, st.booleans())


def close(a: NetCoord, b: NetCoord) -> None:
    assert a.vec == pytest.approx(b.vec, rel=1e-9, abs=1e-9)
    assert a.height_ms == pytest.approx(b.height_ms, rel=1e-9, abs=1e-9)
    assert a.error == pytest.approx(b.error, rel=1e-9, abs=1e-12)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.tuples(coord, st.lists(obs, max_size=12)), min_size=1, max_size=6))
def test_update_many_equals_update_per_endpoint(cases: list[tuple[NetCoord, list[Observation]]]) -> None:
    got = update_many([c for c, _ in cases], [o for _, o in cases])
    for (own, o), new in zip(cases, got, strict=True):
        close(new, update(own, o))


def test_update_many_coincident_points_and_empty_lists() -> None:
    own = NetCoord((1.0, 2.0, 3.0), 1.0, 1.0)
    twin = Observation("peer", NetCoord((1.0, 2.0, 3.0), 1.0, 0.5), 40.0)
    got = update_many([own, own], [[twin], []])
    close(got[0], update(own, [twin]))
    assert got[1] == own


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    st.lists(
        st.tuples(
            st.none() | coord,
            st.dictionaries(st.sampled_from(["p", "q", "r", "s"]), st.floats(1.0, 300.0), max_size=4),
            st.dictionaries(st.sampled_from(["p", "q", "r", "t"]), st.floats(1.0, 300.0), max_size=4),
            st.dictionaries(st.sampled_from(["p", "q", "r", "s", "t"]), st.none() | coord, max_size=5),
        ),
        min_size=1,
        max_size=5,
    )
)
def test_refit_many_equals_refit(items: list) -> None:  # type: ignore[type-arg]
    got = refit_many(items)
    for (own, mine, about, peers), new in zip(items, got, strict=True):
        want = refit(own, mine, about, peers)
        if want is None:
            assert new is None
        else:
            assert new is not None
            close(new, want)
