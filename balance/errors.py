"""The error raised for arguments that cannot be balanced.

It is the same class as ``pipeline.BalanceError``, raised by ``Pipe`` for a
bad ``balance``, so one ``except BalanceError`` catches both.
"""

from pipeline.arguments import BalanceError

__all__ = ["BalanceError"]
