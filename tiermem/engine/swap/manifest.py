"""The swap manifest: which extents hold the committed version of each key.

Layout (JSON, one object, UTF-8)::

    {"format": 1, "job": "<job id>", "generation": <int>, "stripe_nbytes": <int>,
     "files": ["<file name>", ...],                 # one per swap directory, in order
     "records": {"<key>": {"version": <int>, "nbytes": <int>,
                           "extents": [[<file index>, <offset>, <nbytes>, <crc32c>], ...]}},
     "crc32c": <int>}                               # over the canonical JSON of everything else

``encode``/``decode`` are pure.  ``write_manifest`` makes a new manifest durable
atomically: write a temp file in the same directory, fsync it, rename it over
the old one, fsync the directory.  A reader sees the old manifest or the new
one, never a mix.  A failure before the rename removes the temp file and leaves
the old manifest as it was (``ManifestNotReplaced``).  ``read_manifest``
returns None when there is none and raises ``CorruptionError`` when its
checksum or structure is wrong.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c

from tiermem.core.errors import CorruptionError
from tiermem.engine.swap.extents import Extent

__all__ = [
    "FORMAT",
    "Manifest",
    "ManifestNotReplaced",
    "ManifestRecord",
    "decode",
    "encode",
    "read_manifest",
    "write_manifest",
]

FORMAT = 1


@dataclass(frozen=True, slots=True)
class ManifestRecord:
    """The committed version of one key."""

    version: int
    nbytes: int
    extents: tuple[Extent, ...]
    crcs: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Manifest:
    job: str
    generation: int
    stripe_nbytes: int
    files: tuple[str, ...]
    records: dict[str, ManifestRecord]


def encode(manifest: Manifest) -> bytes:
    body: dict[str, Any] = {
        "format": FORMAT,
        "job": manifest.job,
        "generation": manifest.generation,
        "stripe_nbytes": manifest.stripe_nbytes,
        "files": list(manifest.files),
        "records": {
            key: {
                "version": r.version,
                "nbytes": r.nbytes,
                "extents": [[e.file, e.offset, e.nbytes, c] for e, c in zip(r.extents, r.crcs, strict=True)],
            }
            for key, r in manifest.records.items()
        },
    }
    body["crc32c"] = crc32c.crc32c(_canonical(body))
    return json.dumps(body, separators=(",", ":")).encode()


def decode(data: bytes, where: str = "manifest") -> Manifest:
    try:
        body = json.loads(data)
        crc = body.pop("crc32c")
        if crc32c.crc32c(_canonical(body)) != crc:
            raise CorruptionError("<manifest>", where, 0, "manifest checksum mismatch")
        if body["format"] != FORMAT:
            raise CorruptionError("<manifest>", where, 0, f"unknown manifest format {body['format']!r}")
        records = {
            str(key): ManifestRecord(
                version=int(r["version"]),
                nbytes=int(r["nbytes"]),
                extents=tuple(Extent(int(f), int(o), int(n)) for f, o, n, _ in r["extents"]),
                crcs=tuple(int(c) for *_, c in r["extents"]),
            )
            for key, r in body["records"].items()
        }
        return Manifest(
            job=str(body["job"]),
            generation=int(body["generation"]),
            stripe_nbytes=int(body["stripe_nbytes"]),
            files=tuple(str(f) for f in body["files"]),
            records=records,
        )
    except CorruptionError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptionError("<manifest>", where, 0, f"malformed manifest: {exc!r}") from None


class ManifestNotReplaced(OSError):
    """Writing a new manifest failed before it replaced the old one (the temp file is removed): the old
    manifest stands, unchanged and durable as before."""


def write_manifest(path: Path, manifest: Manifest, *, fsync: bool = True) -> None:
    """Replace the manifest at ``path`` atomically (see the module docstring).

    ``ManifestNotReplaced`` when it failed before the rename (ENOSPC writing the temp file, say); any other
    ``OSError`` came after it, when the new manifest may or may not have become durable."""
    data = encode(manifest)
    tmp = path.with_name(path.name + ".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):  # a directory in its way stays: unlink refuses it
            tmp.unlink()
        raise ManifestNotReplaced(exc.errno, exc.strerror, str(tmp)) from exc
    if fsync:
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def read_manifest(path: Path) -> Manifest | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    return decode(data, str(path))


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
