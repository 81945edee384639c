"""Errors a user can cause and fix (bad data, bad config, bad paths).

The CLI turns any :class:`UserError` into one line on stderr and a non-zero exit,
without a traceback. Bugs stay ordinary exceptions with tracebacks.
"""

import re


class UserError(Exception):
    """Base of all user-fixable errors; its message is one line naming the culprit."""


class DataError(UserError):
    """Bad input data: names the file, column and row group where it applies."""

    def __init__(
        self,
        message: str,
        file: str | None = None,
        column: str | None = None,
        row_group: int | None = None,
        row: int | None = None,
    ) -> None:
        where = []
        if file is not None:
            where.append(f"file {file}")
        if column is not None:
            where.append(f"column {column!r}")
        if row_group is not None:
            where.append(f"row group {row_group}")
        if row is not None:
            where.append(f"row {row}")
        # one line: a library's message quoted in it may run over several (pyarrow's
        # "cannot read (...)" of a corrupt page printed three, the last a lone ")")
        message = re.sub(r"\s*\n\s*", " ", message.strip())
        self.file, self.column, self.row_group, self.row = file, column, row_group, row
        self.reason = message  # the message without its place
        super().__init__(f"{', '.join(where)}: {message}" if where else message)

    def __reduce__(self) -> tuple:
        """Pickled whole (a decode worker's error reaches the consumer as it was raised)."""
        return type(self), (self.reason, self.file, self.column, self.row_group, self.row)


def quoted(error: BaseException, limit: int = 200) -> str:
    """A library's message, as one line of at most ``limit`` characters, to quote in ours
    ("cannot read (...)")."""
    text = "".join(c if c.isprintable() else " " for c in str(error))
    return " ".join(text.split())[:limit]


def one_line(error: BaseException, named: bool = False) -> str:
    """The first line of an exception's message (its type's name if it has none;
    ``named``: always "Type: line"): many libraries' messages run over several lines,
    and a user error is one line."""
    lines = str(error).strip().splitlines()
    if not lines:
        return type(error).__name__
    return f"{type(error).__name__}: {lines[0]}" if named else lines[0]
