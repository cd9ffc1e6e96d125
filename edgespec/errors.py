"""The one exception type users see.

Everything a user can cause (a wrong path, a corrupt file, a prompt that does not fit)
raises `EdgespecError` with one sentence that says what is wrong and what to do; the CLI
prints that sentence and exits non-zero instead of showing a traceback. Anything else is
a bug and keeps its traceback.
"""


class EdgespecError(Exception):
    """A problem with the user's input or environment, explained in one sentence."""
