"""Errors qrun raises for bad input. Each message names the problem and the fix."""


class QrunError(Exception):
    """Base class: the CLI prints these as one line, without a traceback."""


class ModelLoadError(QrunError):
    """A model source is missing, corrupt, or of an unsupported kind."""


def one_line(err: BaseException) -> str:
    """An exception's message as one line, for quoting a library's error (theirs may span several)."""
    return " ".join(str(err).split()) or type(err).__name__


class RequestError(QrunError, ValueError):
    """A request can never be served (too long for the context or the KV cache)."""


class RequestFailed(QrunError):
    """The engine failed a request while serving it (`RequestOutput.error` says why)."""


class EngineStopped(QrunError):
    """The engine's loop has stopped (shut down, or failed): it serves no more requests."""
