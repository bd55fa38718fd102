"""The one exception type for user errors; the CLI prints its message as one line and exits 1."""


class UserError(Exception):
    """A problem the user can fix: the message names the bad value and what to do."""
