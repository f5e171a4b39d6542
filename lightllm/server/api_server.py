"""``python -m lightllm.server.api_server --model_dir DIR [...]``: start the server."""

import sys

from lightllm.server.api_start import run_server

if __name__ == "__main__":
    sys.exit(run_server())
