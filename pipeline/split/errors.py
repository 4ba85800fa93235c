"""SplitError: what ``pipeline.split`` refuses, with the module, the line and what to do."""

__all__ = ["SplitError"]


class SplitError(ValueError):
    """A model that ``pipeline.split`` cannot split; the message says where and what to do."""
