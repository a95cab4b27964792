"""Test ids for parameters that hold control characters, backslashes or long text."""

from __future__ import annotations

from collections.abc import Callable


def plain_ids(length: int, tail: bool = False) -> Callable[[object], str]:
    """An `ids=` function: a parameter's first (`tail`: last) `length` characters, each one that
    pytest would escape spelled as `<hex>`. pytest escapes `\\n`, NUL and a backslash in an id,
    and a child that mutmut forks after collecting cannot select such an id again: pytest exits
    with a usage error, which mutmut records as the mutant killed with no test run."""
    def plain(value: object) -> str:
        text = str(value)
        text = text[-length:] if tail else text[:length]
        return "".join(c if c.isprintable() and c != "\\" else f"<{ord(c):x}>" for c in text)
    return plain
