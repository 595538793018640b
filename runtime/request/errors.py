"""The one error type for a request the runtime refuses because of what it asks for.

It carries the field at fault as data, so the Engine (a ValueError), the server (a 400 whose
``param`` is that field) and the DSL report the same thing, and nothing has to recover a field
name from a message string.
"""

from __future__ import annotations


class RequestError(ValueError):
    """``field`` is the input at fault (None: the request as a whole), ``problem`` the rest of the
    sentence, ``section`` the object holding the field (``"sampling_params"`` for SamplingParams'
    own checks), ``status`` the HTTP status a server answers with; ``named``: ``problem`` is a whole
    message that names the field itself (shown as it is)."""

    def __init__(self, field: str | None, problem: str, section: str | None = None, status: int = 400,
                 named: bool = False):
        self.field = field
        self.problem = problem
        self.section = section
        self.status = status
        self.named = named
        super().__init__(self.describe(field))

    def describe(self, name: str | None) -> str:
        """The message with the field shown as ``name`` (an API's own spelling of it)."""
        if self.named:  # a whole message (e.g. a grammar backend's) that names the field itself
            return self.problem
        return f"{name} {self.problem}" if name else self.problem

    @classmethod
    def from_finish(cls, finish, fallback_field: str | None = None) -> RequestError | None:
        """The error of a generation the runtime refused because of the request itself (an abort
        with code 400, e.g. a grammar that does not compile); None for any other finish."""
        if finish is None or finish.type != "abort" or finish.code is None or not 400 <= finish.code < 500:
            return None
        return cls(finish.field or fallback_field, finish.message or "invalid request", section="sampling_params",
                   status=finish.code, named=True)

    def __reduce__(self):  # keep the fields when copied or pickled within a process
        return (type(self), (self.field, self.problem, self.section, self.status, self.named))
