"""Line numbers of a TOML file's ``[[rule]]`` headers, for error messages.

tomllib keeps no positions, so the text is scanned; a plain search for lines starting with
``[[rule`` misses ``[[ rule ]]`` and counts text inside multi-line strings and arrays. This
scan skips strings, comments and open brackets, as a TOML parser would.
"""

from __future__ import annotations

import re

_HEADER = r"""\[\[\s*(?:{0}|"{0}"|'{0}')\s*\]\]\s*(?:#.*)?"""


def header_lines(text: str, table: str = "rule") -> list[int]:
    """1-based lines of the ``[[table]]`` headers, in order."""
    header = re.compile(_HEADER.format(re.escape(table)))
    found: list[int] = []
    closing: str | None = None  # the delimiter of the multi-line string the scan is in
    depth = 0  # brackets open in a value (an array spanning lines)
    for lineno, line in enumerate(text.split("\n"), 1):  # TOML counts "\n" only
        if closing is None and depth == 0 and header.fullmatch(line.strip()):
            found.append(lineno)
            continue
        i = 0
        while i < len(line):
            if closing is not None:
                i = _close(line, i, closing)
                if i < 0:
                    break
                closing = None
                continue
            c = line[i]
            if c == "#":
                break
            if line.startswith(('"""', "'''"), i):
                closing, i = line[i : i + 3], i + 3
            elif c in "\"'":
                i = _end_of_string(line, i)
            else:
                depth += (c == "[") - (c == "]")
                i += 1
    return found


def _close(line: str, i: int, delim: str) -> int:
    """Index just past the end of a multi-line string that began earlier, or -1."""
    while i < len(line):
        if delim == '"""' and line[i] == "\\":
            i += 2
        elif line.startswith(delim, i):
            end = i + 3
            while end < len(line) and end - i < 5 and line[end] == delim[0]:
                end += 1  # up to two quotes may end the string's text
            return end
        else:
            i += 1
    return -1


def _end_of_string(line: str, i: int) -> int:
    quote, i = line[i], i + 1
    while i < len(line):
        if quote == '"' and line[i] == "\\":
            i += 2
        elif line[i] == quote:
            return i + 1
        else:
            i += 1
    return len(line)
