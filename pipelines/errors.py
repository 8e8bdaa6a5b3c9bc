"""The one exception type users see without a traceback."""


class QllmError(Exception):
    """An error the user can act on (bad input, bad params, missing file): printed as one clear
    message naming the file, line or key, with a non-zero exit code and no traceback."""
