"""The one error type of start-up settings: an impossible flag or environment setting.

It lives in a leaf module so that every package that checks a setting at start-up (launch, the
listen sockets, the PD transfer ports) can raise it without importing the launcher; the
launcher turns it into a one-line message and exit code 2.
"""


class ArgumentError(ValueError):
    """An impossible flag, combination of flags, or environment setting; the message names it."""
