"""Where a text file stops being UTF-8: the readers' errors name ``path:line`` with it.

A ``UnicodeDecodeError`` raised while reading through a text stream gives a position inside
the decoder's current buffer, not in the file, so the readers catch it and rescan the file
here, line by line in binary (a newline byte never occurs inside a multi-byte UTF-8 sequence,
so decoding each line alone finds the same first error).
"""
from __future__ import annotations

from typing import Optional, Tuple


def first_non_utf8(path: str) -> Optional[Tuple[int, int, int]]:
    """(line, byte column, byte value) of the first invalid UTF-8 sequence (1-based), or None."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return lineno, e.start + 1, raw[e.start]
    return None


def non_utf8_error(path: str, what: str = "UTF-8 text") -> Tuple[Optional[int], str]:
    """(line, message) describing why ``path`` is not UTF-8, for the caller's error type."""
    found = first_non_utf8(path)
    if found is None:  # the file changed since it was read
        return None, f"expected {what}, found bytes that are not UTF-8"
    line, col, byte = found
    return line, f"expected {what}, found byte 0x{byte:02x} (not UTF-8) at column {col}"
