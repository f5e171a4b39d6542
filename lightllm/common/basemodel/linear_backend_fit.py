"""What the flags alone tell about ``--linear_backend onednn``, without torch.

The launcher imports no torch, yet a device or dtype oneDNN projections never take should be
refused before any process starts, not after every rank started and loaded its weights; the
rank (:func:`~lightllm.common.basemodel.linear_kernels.onednn_problem`) asks the same first,
then what needs torch (the build's oneDNN, a test product).
"""

from __future__ import annotations

from typing import Optional

ONEDNN_DTYPES = ("float32", "bfloat16")


def onednn_setting_problem(device: str, dtype_name: str) -> Optional[str]:
    """Why oneDNN projections cannot run on ``device`` in ``dtype_name`` (one line), or None."""
    if device != "cpu":
        return f"oneDNN projections run on CPU only (the device is {device})"
    if dtype_name not in ONEDNN_DTYPES:
        return f"oneDNN projections take float32 or bfloat16 weights, not {dtype_name}"
    return None


def onednn_refusal(problem: str) -> str:
    """The one-line refusal of an explicit ``--linear_backend onednn`` that cannot run because of ``problem``."""
    return f"--linear_backend onednn cannot run here: {problem}; use --linear_backend torch"
