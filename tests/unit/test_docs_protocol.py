"""docs/protocol.md against the codec: its version is the protocol's, and its example frames are the encoder's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tiermem.core.protocol import PROTOCOL_VERSION, SUPPORTED_VERSIONS, decode_frame, decode_message, encode_message

PROTOCOL_MD = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
TEXT = PROTOCOL_MD.read_text()


def example_frames(markdown: str) -> list[bytes]:
    """Each code block of the "Example frames" section: a header in hex, then the payload on its own line."""
    section = markdown[markdown.index("## Example frames") :]
    section = section[: section.index("\n## ", 1)]
    frames = []
    for block in re.findall(r"```\n(.*?)```", section, re.S):
        header, *payload = block.strip().splitlines()
        frames.append(bytes.fromhex(header.replace(" ", "")) + "".join(payload).encode())
    return frames


def test_the_document_names_the_protocol_version() -> None:
    assert TEXT.startswith(f"# The tiermem wire protocol (version {PROTOCOL_VERSION})\n")
    assert f"| ver | protocol version, {PROTOCOL_VERSION} |" in TEXT
    assert f"`SUPPORTED_VERSIONS` (now `{SUPPORTED_VERSIONS!r}`)" in TEXT


@pytest.mark.parametrize("frame", example_frames(TEXT), ids=lambda f: f"type-{f[3]:#04x}")
def test_each_example_frame_is_what_the_encoder_writes(frame: bytes) -> None:
    decoded = decode_frame(frame)
    assert encode_message(decode_message(decoded), decoded.request_id, decoded.flags) == frame


def test_the_examples_are_found() -> None:
    assert len(example_frames(TEXT)) == 3
