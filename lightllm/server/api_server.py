"""``python -m lightllm.server.api_server --model_dir DIR [...]``: start the server."""

import logging
import os
import sys

from lightllm.server.launch.start import run_server

if __name__ == "__main__":
    code = run_server()
    # run_server has stopped every child and removed every shared resource; what is left is
    # interpreter finalization, which takes seconds with torch loaded on a busy machine and
    # would push the exit past the bound operators rely on (see docs/*/failure_handling.md).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
