"""The error of an attention backend that cannot run here, apart so kernels and the selection both raise it."""


class AttentionBackendError(ValueError):
    """The requested backend cannot run here (message fits one line)."""
