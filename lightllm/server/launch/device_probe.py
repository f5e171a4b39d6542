"""The machine's CUDA facts for the launcher, asked of a short-lived child that imports torch.

The launcher process serves HTTP for the server's whole life and imports no torch (only the model
ranks do: docs/EN/architecture.md, "Which process loads torch"). Whether CUDA is usable, how many
devices are visible and how much memory the first one has free are questions only torch answers
the way a rank will see them (``CUDA_VISIBLE_DEVICES``, a CPU-only build, a ROCm build), so the
launcher runs ``python -m lightllm.server.launch.device_probe``, which imports torch, prints one
JSON line and exits; the CUDA context it made goes with it instead of staying in the HTTP process.

The probe is skipped when the answer is known without torch: ``--device cpu``, or an installed
torch built without CUDA or ROCm (its ``torch/version.py`` read as text), which is every CPU
machine this project is tested on, so a CPU start pays no extra torch import.
"""

from __future__ import annotations

import ast
import importlib.machinery
import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

# A first CUDA initialisation on a large machine can take tens of seconds.
PROBE_TIMEOUT_SECONDS = 300.0


class DeviceProbeError(RuntimeError):
    """The probe child failed or answered nonsense (the message fits one line)."""


@dataclass(frozen=True)
class DeviceFacts:
    """What the launcher needs to know about CUDA before it sizes the server."""

    cuda_available: bool
    cuda_device_count: int
    # Free memory of the first visible device (where the KV budget is measured), None without CUDA.
    cuda_free_bytes: Optional[int] = None
    # True when a probe child answered; False when the facts were known without torch.
    probed: bool = False

    @classmethod
    def without_cuda(cls) -> "DeviceFacts":
        """No CUDA device, known without asking torch."""
        return cls(cuda_available=False, cuda_device_count=0)


def torch_build_has_gpu() -> bool:
    """Whether the installed torch is a CUDA or ROCm build, read from ``torch/version.py`` without importing torch.

    False when torch is not installed; True when the file cannot be read or parsed (then the
    probe decides). Looks on ``sys.path`` itself: in the launcher torch is made unimportable
    (:func:`lightllm.utils.torch_free.keep_torch_out`), which hides it from ``find_spec``.
    """
    try:
        spec = importlib.machinery.PathFinder.find_spec("torch")
    except (ImportError, ValueError):
        return True
    if spec is None or not spec.origin:
        return False
    try:
        tree = ast.parse(Path(spec.origin).with_name("version.py").read_text())
    except (OSError, SyntaxError, ValueError):
        return True
    values = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else getattr(node, "target", None)
        if isinstance(target, ast.Name) and isinstance(getattr(node, "value", None), ast.Constant):
            values[target.id] = node.value.value  # type: ignore[union-attr]
    if "cuda" not in values and "hip" not in values:
        return True
    return values.get("cuda") is not None or values.get("hip") is not None


def measure() -> DeviceFacts:
    """The facts as torch sees them in this process (the probe child's work; imports torch)."""
    import torch

    available = bool(torch.cuda.is_available())
    count = int(torch.cuda.device_count()) if available else 0
    free = int(torch.cuda.mem_get_info()[0]) if count else None
    return DeviceFacts(cuda_available=available and count > 0, cuda_device_count=count, cuda_free_bytes=free,
                       probed=True)


def parse_answer(stdout: str) -> DeviceFacts:
    """The facts from the probe's output (its last line is the JSON answer)."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise DeviceProbeError("the device probe printed nothing")
    try:
        raw = json.loads(lines[-1])
        facts = DeviceFacts(
            cuda_available=bool(raw["cuda_available"]),
            cuda_device_count=int(raw["cuda_device_count"]),
            cuda_free_bytes=None if raw.get("cuda_free_bytes") is None else int(raw["cuda_free_bytes"]),
            probed=True,
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise DeviceProbeError(f"the device probe answered {lines[-1][:200]!r}: {exc}") from None
    if facts.cuda_available and facts.cuda_free_bytes is None:
        raise DeviceProbeError("the device probe found CUDA but did not report its free memory")
    return facts


def run_probe(timeout_s: float = PROBE_TIMEOUT_SECONDS) -> DeviceFacts:
    """Run ``python -m lightllm.server.launch.device_probe`` and read its answer."""
    command = [sys.executable, "-m", "lightllm.server.launch.device_probe"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise DeviceProbeError(f"the device probe ({' '.join(command[1:])}) did not answer within {timeout_s:.0f}s") from None
    except OSError as exc:
        raise DeviceProbeError(f"cannot run the device probe: {exc}") from None
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise DeviceProbeError(f"the device probe ({' '.join(command[1:])}) failed with exit code "
                               f"{result.returncode}: {last}")
    return parse_answer(result.stdout)


def read_device_facts(device_flag: str) -> DeviceFacts:
    """The CUDA facts for ``--device device_flag``: without a child when torch cannot see a GPU anyway."""
    if device_flag == "cpu" or not torch_build_has_gpu():
        return DeviceFacts.without_cuda()
    return run_probe()


def main() -> None:
    """Print the facts as one JSON line."""
    print(json.dumps(asdict(measure())), flush=True)


if __name__ == "__main__":
    main()
