"""What the console scripts share about their output: names shown safely, and a closed
pipe treated as the reader's choice (``kvfs-stat | head``), not an error."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def shown(name: str) -> str:
    """A session or file name for a terminal: printable characters as they are, anything
    else (escape sequences, newlines, bytes that are not UTF-8) as Python escapes, so a
    name cannot move the cursor, retitle the window or forge a line."""
    if name.isprintable():
        return name
    return repr(name)[1:-1]


def pipe_safe(main: Callable[..., int]) -> Callable[..., int]:
    """Wrap a console script's ``main``: when whoever reads stdout goes away (``| head``),
    stop quietly with the usual exit status instead of a BrokenPipeError traceback."""

    @functools.wraps(main)
    def wrapper(*a: object, **kw: object) -> int:
        try:
            rc = main(*a, **kw)
            sys.stdout.flush()
            return rc
        except BrokenPipeError:
            # Python flushes stdout again at exit: point it at /dev/null so that flush is
            # quiet too (the recipe in the signal module's documentation)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            return 0

    return wrapper
