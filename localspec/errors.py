"""The one exception type a user may see: its message is printed as a single line, no traceback."""


class LocalspecError(Exception):
    """A problem the user can act on (bad option, unknown model, prompt too long, ...)."""
