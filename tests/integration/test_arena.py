"""Arena: a real memfd, sealed, pre-faulted, locked, bounds-checked, safe to close."""

from __future__ import annotations

import ctypes
import errno
import os

import pytest

from tiermem.core.errors import BoundsError, InvalidArgument, InvalidState
from tiermem.core.units import KiB, MiB
from tiermem.engine.pool import Arena, MlockRefusal, memlock_warning


def resident_bytes(address: int) -> int:
    """Rss of the mapping that contains ``address``, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):
                low, high = (int(x, 16) for x in first.split("-"))
                inside = low <= address < high
            elif inside and first == "Rss:":
                return int(line.split()[1]) * 1024
    raise LookupError(f"no mapping holds {address:#x}")


def test_create_rounds_up_to_pages_and_seals_the_size() -> None:
    with Arena.create(10_000, name="seal-test") as arena:
        assert arena.nbytes == 12 * KiB
        assert os.fstat(arena.fd).st_size == 12 * KiB
        assert arena.sealed
        for size in (4 * KiB, 64 * KiB):
            with pytest.raises(PermissionError):
                os.ftruncate(arena.fd, size)
        assert arena.address % 4096 == 0


def test_arena_is_resident_right_after_creation() -> None:
    with Arena.create(8 * MiB, mlock=False) as arena:
        assert resident_bytes(arena.address) == 8 * MiB


def test_root_arena_is_locked() -> None:
    if os.geteuid() != 0:
        pytest.skip("mlock of 4MiB needs root or a generous RLIMIT_MEMLOCK")
    with Arena.create(4 * MiB) as arena:
        assert arena.locked and arena.mlock_refusal is None
    with Arena.create(4 * MiB, mlock=False) as arena:
        assert not arena.locked


def test_view_writes_land_at_the_address() -> None:
    with Arena.create(64 * KiB) as arena:
        arena.view(4096, 4)[:] = b"abcd"
        assert ctypes.string_at(arena.address + 4096, 4) == b"abcd"


@pytest.mark.parametrize(("offset", "nbytes"), [(-1, 1), (0, 64 * KiB + 1), (64 * KiB, 1), (4096, -5)])
def test_view_outside_the_arena_is_a_bounds_error(offset: int, nbytes: int) -> None:
    with Arena.create(64 * KiB) as arena, pytest.raises(BoundsError):
        arena.view(offset, nbytes)


def test_view_up_to_the_end_is_allowed() -> None:
    with Arena.create(64 * KiB) as arena:
        assert len(arena.view(64 * KiB - 1, 1)) == 1
        assert len(arena.view(64 * KiB, 0)) == 0


@pytest.mark.parametrize("nbytes", [0, -4096, 1.5, True])
def test_create_rejects_sizes_that_are_not_positive_integers(nbytes: object) -> None:
    with pytest.raises(InvalidArgument):
        Arena.create(nbytes)  # type: ignore[arg-type]


def test_close_with_live_views_keeps_them_readable_and_refuses_new_ones() -> None:
    arena = Arena.create(64 * KiB)
    view = arena.view(0, 8)
    view[:] = b"survives"
    arena.close()
    assert arena.closed
    assert bytes(view) == b"survives"
    with pytest.raises(InvalidState):
        arena.view(0, 8)
    with pytest.raises(InvalidState):
        _ = arena.fd
    arena.close()  # twice is fine
    view.release()


def test_close_releases_the_fd() -> None:
    arena = Arena.create(64 * KiB)
    fd = arena.fd
    arena.close()
    with pytest.raises(OSError) as info:
        os.fstat(fd)
    assert info.value.errno == errno.EBADF


def test_from_fd_maps_the_same_memory() -> None:
    with Arena.create(64 * KiB) as arena:
        with Arena.from_fd(os.dup(arena.fd)) as other:
            assert other.nbytes == 64 * KiB and other.sealed
            other.view(100, 3)[:] = b"xyz"
        assert bytes(arena.view(100, 3)) == b"xyz"


def test_from_fd_read_only_maps_without_write_access() -> None:
    with Arena.create(64 * KiB) as arena:
        arena.view(0, 2)[:] = b"ro"
        with Arena.from_fd(os.dup(arena.fd), writable=False) as other:
            view = other.view(0, 2)
            assert bytes(view) == b"ro" and view.readonly
            view.release()


def test_from_fd_larger_than_the_segment_is_a_bounds_error() -> None:
    with Arena.create(64 * KiB) as arena:
        fd = os.dup(arena.fd)
        try:
            with pytest.raises(BoundsError):
                Arena.from_fd(fd, 128 * KiB)
        finally:
            os.close(fd)


def test_memlock_warning_names_the_limit_sizes_and_the_fix() -> None:
    refused = [MlockRefusal(8 * MiB, errno.ENOMEM, 64 * KiB, 64 * KiB)] * 2
    text = memlock_warning(refused, 32 * MiB)
    for part in ("16MiB of 32MiB", "RLIMIT_MEMLOCK is 64KiB", "LimitMEMLOCK=infinity", "ulimit -l unlimited"):
        assert part in text
