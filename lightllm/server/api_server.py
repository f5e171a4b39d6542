"""``python -m lightllm.server.api_server --model_dir DIR [...]``: start the server."""

import logging
import os
import sys

if __name__ == "__main__":
    from lightllm.utils.torch_free import keep_torch_out

    # This process serves HTTP (or is the PD master) for the server's life and never needs torch;
    # without this, transformers would load it for the tokenizer (lightllm/utils/torch_free.py).
    keep_torch_out()
    # Imported here, not at the top: every spawned child re-runs this module (as __mp_main__)
    # before its own entry, and should not load the launcher's HTTP and planning code for it.
    from lightllm.server.launch.start import run_server

    code = run_server()
    # run_server has stopped every child and removed every shared resource; what is left is
    # interpreter finalization, which takes seconds with torch loaded on a busy machine and
    # would push the exit past the bound operators rely on (see docs/*/failure_handling.md).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
