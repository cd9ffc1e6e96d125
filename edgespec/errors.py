"""The one exception type users see.

Everything a user can cause (a wrong path, a corrupt file, a prompt that does not fit)
raises `EdgespecError` with one sentence that says what is wrong and what to do; the CLI
prints that sentence and exits non-zero instead of showing a traceback. Anything else is
a bug and keeps its traceback.
"""


class EdgespecError(Exception):
    """A problem with the user's input or environment, explained in one sentence."""


class WriteError(EdgespecError):
    """A bundle could not be written (a full disk, no permission), nothing left behind;
    `reason` and `full` let a caller that chose the place itself (the model cache) give
    its own advice."""

    def __init__(self, message: str, reason: str, full: bool):
        super().__init__(message)
        self.reason, self.full = reason, full


class DamagedBundleError(EdgespecError):
    """A bundle's file is missing or does not match its sha256: copied or cached badly,
    so a cached export is made again (model_cache.open_cached)."""
