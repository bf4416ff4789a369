"""Exceptions shared by every layer. No third-party imports."""


class PdserveError(Exception):
    """Base class of every error pdserve raises on purpose."""


class InvalidRequestError(PdserveError, ValueError):
    """The caller asked for something that cannot be served (bad prompt, bad sampling parameters).

    Raised before any work is queued, so nothing is lost and nothing leaks. `param`: the field
    of the request that is wrong, where one is (OpenAI's error body names it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelLoadError(PdserveError):
    """A model could not be loaded: missing file, corrupt file, unsupported architecture."""


class UnsupportedModelError(ModelLoadError):
    """The model's architecture or one of its features is not implemented."""
