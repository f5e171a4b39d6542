"""Only the model rank loads torch: every other process's code imports without it.

The entry modules of the HTTP process (which is the launcher), the router, the detokenizer and
the PD master are imported in a fresh interpreter whose import system refuses ``torch``; so is
every module those processes may import later, and every module of the scheduling core. Those
processes make torch unimportable for themselves (lightllm/utils/torch_free.py), so transformers
tokenizes there without it. The launcher gets the facts that need torch from a probe child or
leaves them to the rank (a refused backend still ends the start with exit code 2); both paths are
checked here too. test/integration/test_torch_free_server.py checks a running server's maps.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from lightllm.server.launch.device_probe import DeviceFacts, DeviceProbeError, parse_answer, torch_build_has_gpu
from lightllm.server.launch.exit_codes import EXIT_INVALID_CONFIG
from lightllm.utils.free_ports import free_port

# The entry module of each process that must not load torch (spawned children also re-run the
# launcher's main module, lightllm.server.api_server).
ENTRY_MODULES = [
    "lightllm.server.api_server",
    "lightllm.server.launch.start",
    "lightllm.server.launch.child_entry",
    "lightllm.server.launch.device_probe",
    "lightllm.server.router.manager",
    "lightllm.server.detokenization.manager",
    "lightllm.server.launch.pd_master",
    "lightllm.server.launch.pd_node",
]
SCHEDULING_PACKAGE = "lightllm.server.model_rank.scheduling"
# Everything the launcher (HTTP, PD master and node endpoints), the router and the detokenizer may
# import later, at run time: torch is unimportable there (lightllm/utils/torch_free.py), so a module
# of these packages that needs it would fail when first used.
TORCH_FREE_PACKAGES = [
    "lightllm.server.http", "lightllm.server.httpserver", "lightllm.server.launch", "lightllm.server.pd.master",
    "lightllm.server.pd.node", "lightllm.server.pd.protocol", "lightllm.server.router",
    "lightllm.server.detokenization", "lightllm.server.core", SCHEDULING_PACKAGE,
]
# Loads torch by design: the blocked import must fail, or the blocker is not doing its job.
TORCH_MODULE = "lightllm.server.model_rank.rank_assembly"

# Runs in a fresh interpreter: refuse torch, import each module, answer {module: error or ""}.
_BLOCKED_IMPORTS = r"""
import importlib, json, pkgutil, sys

class RefuseTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is refused in this process: " + name)
        return None

sys.meta_path.insert(0, RefuseTorch())
modules = json.loads(sys.argv[1])
for name in json.loads(sys.argv[2]):
    package = importlib.import_module(name)
    modules += [info.name for info in pkgutil.walk_packages(package.__path__, name + ".")]
result = {}
for name in modules + [sys.argv[3]]:
    try:
        importlib.import_module(name)
        result[name] = ""
    except Exception as exc:
        result[name] = f"{type(exc).__name__}: {exc}"
result["torch loaded"] = "torch" in sys.modules
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def blocked_imports() -> Dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCKED_IMPORTS, json.dumps(ENTRY_MODULES), json.dumps(TORCH_FREE_PACKAGES),
         TORCH_MODULE],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_blocker_refuses_torch(blocked_imports: Dict[str, object]) -> None:
    assert "torch is refused" in str(blocked_imports[TORCH_MODULE])
    assert blocked_imports["torch loaded"] is False


@pytest.mark.parametrize("module", ENTRY_MODULES)
def test_process_entry_imports_without_torch(blocked_imports: Dict[str, object], module: str) -> None:
    assert blocked_imports[module] == "", f"{module} needs torch: {blocked_imports[module]}"


def test_the_whole_scheduling_core_imports_without_torch(blocked_imports: Dict[str, object]) -> None:
    scheduling = {name: error for name, error in blocked_imports.items() if name.startswith(SCHEDULING_PACKAGE + ".")}
    assert len(scheduling) >= 10  # the walk found the package's modules
    assert {name: error for name, error in scheduling.items() if error} == {}


def test_what_the_torch_free_processes_may_import_later_needs_no_torch(blocked_imports: Dict[str, object]) -> None:
    walked = [name for name in blocked_imports if name.startswith(tuple(p + "." for p in TORCH_FREE_PACKAGES))]
    assert len(walked) >= 80
    assert {name: blocked_imports[name] for name in walked if blocked_imports[name]} == {}


def test_the_entries_import_no_torch_even_where_it_is_installed() -> None:
    # Without the blocker: a library that swallows the blocked import would hide a torch import above.
    code = ("import importlib, json, sys\n"
            f"for name in {ENTRY_MODULES!r}: importlib.import_module(name)\n"
            "print(json.dumps(sorted(m for m in ('torch', 'transformers') if m in sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_a_process_that_keeps_torch_out_still_tokenizes(tiny_llama_dir: Path) -> None:
    # transformers would import torch for the tokenizer; with torch kept out it runs without it, quietly.
    code = ("import sys\n"
            "from lightllm.utils.torch_free import keep_torch_out\n"
            "assert keep_torch_out()\n"
            "from lightllm.utils.tokenizer_utils import load_tokenizer\n"
            f"tokenizer = load_tokenizer({str(tiny_llama_dir)!r})\n"
            "ids = tokenizer.encode('hello world')\n"
            "assert tokenizer.decode(ids, skip_special_tokens=True).strip() == 'hello world', ids\n"
            "try:\n"
            "    import torch\n"
            "except ImportError:\n"
            "    print('torch refused')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "torch refused"
    assert "PyTorch was not found" not in proc.stderr


def test_the_torch_build_is_read_without_importing_torch() -> None:
    import torch

    assert torch_build_has_gpu() == (torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None)


def test_probe_answers_are_parsed_and_checked() -> None:
    facts = parse_answer('a warning\n{"cuda_available": true, "cuda_device_count": 2, "cuda_free_bytes": 1024}\n')
    assert facts == DeviceFacts(cuda_available=True, cuda_device_count=2, cuda_free_bytes=1024, probed=True)
    with pytest.raises(DeviceProbeError, match="printed nothing"):
        parse_answer("")
    with pytest.raises(DeviceProbeError, match="answered"):
        parse_answer("not json")
    with pytest.raises(DeviceProbeError, match="free memory"):
        parse_answer('{"cuda_available": true, "cuda_device_count": 1, "cuda_free_bytes": null}')


def test_the_probe_child_sees_what_torch_sees() -> None:
    import torch

    proc = subprocess.run([sys.executable, "-m", "lightllm.server.launch.device_probe"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    facts = parse_answer(proc.stdout)
    assert facts.cuda_available == torch.cuda.is_available()
    assert facts.cuda_device_count == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert (facts.cuda_free_bytes is not None) == facts.cuda_available


def _launch(args: List[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightllm.server.api_server", *args], capture_output=True,
                          text=True, timeout=300)


def test_a_backend_the_rank_refuses_ends_the_start_in_one_line_with_exit_2(tiny_llama_dir: Path) -> None:
    # oneDNN takes no float16 weights: the rank finds out (the launcher has no torch to ask) and
    # the launcher prints the refusal as it printed its own before.
    proc = _launch(["--model_dir", str(tiny_llama_dir), "--port", str(free_port()), "--device", "cpu",
                    "--data_type", "float16", "--linear_backend", "onednn", "--max_total_token_num", "4096"])
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == EXIT_INVALID_CONFIG, lines
    errors = [line for line in lines if line.startswith("error:")]
    assert errors == ["error: --linear_backend onednn cannot run here: oneDNN projections take float32 or bfloat16 "
                      "weights, not float16; use --linear_backend torch"], lines
    assert not any("serving on" in line for line in lines)
