"""Errors a user can cause. The CLI turns these into one `error: ...` line and exit code 2."""


class PiperError(Exception):
    """Bad input: a model file, strategy, directive or flag that cannot be honoured."""


class DirectiveError(PiperError):
    """A directive whose preconditions do not hold; the message names it and its index."""

    def __init__(self, index: int, directive: object, reason: str) -> None:
        super().__init__(f"directive {index} ({directive!r}): {reason}")
        self.index = index
        self.directive = directive
        self.reason = reason
