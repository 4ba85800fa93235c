"""The error raised for arguments that cannot be balanced."""


class BalanceError(ValueError):
    """A value given to :mod:`balance` cannot be balanced; the message names it and the fix."""
