from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiermem.core.units import GiB, KiB, MiB, align_up, format_size, parse_size


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("0", 0),
        ("4096", 4096),
        ("4KiB", 4 * KiB),
        ("4k", 4 * KiB),
        ("512 MiB", 512 * MiB),
        ("8GiB", 8 * GiB),
        ("8gib", 8 * GiB),
        ("1.5GiB", 3 * GiB // 2),
        ("2GB", 2_000_000_000),
        (1234, 1234),
    ],
)
def test_parse_size_accepts_common_forms(text: str | int, nbytes: int) -> None:
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("bad", ["", "GiB", "-1", "8 parsecs", "1.3B", True, None, -5, "8GiB8"])
def test_parse_size_rejects_garbage_with_the_value_named(bad: object) -> None:
    with pytest.raises(ValueError, match=r"size|unit|number|bytes"):
        parse_size(bad)  # type: ignore[arg-type]


@given(st.integers(min_value=0, max_value=1 << 50))
def test_format_then_parse_is_close(nbytes: int) -> None:
    text = format_size(nbytes)
    back = parse_size(text) if "." not in text else None
    if back is not None:
        assert back == nbytes
    assert text[0].isdigit()


@given(st.integers(min_value=0, max_value=1 << 40), st.sampled_from([4096, 8192, 1 << 20]))
def test_align_up_is_the_smallest_multiple_not_below(nbytes: int, alignment: int) -> None:
    aligned = align_up(nbytes, alignment)
    assert aligned % alignment == 0
    assert nbytes <= aligned < nbytes + alignment
