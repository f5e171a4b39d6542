"""The grammar checks of structured output and forced tool calls run in the HTTP process, which keeps torch
out (lightllm.utils.torch_free): they must work there, not only in a test process that has torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_grammars_are_checked_without_torch() -> None:
    script = textwrap.dedent("""
        from lightllm.utils.torch_free import keep_torch_out
        assert keep_torch_out()
        from lightllm.server.http.errors import APIError
        from lightllm.server.http.structured.response_format import compile_json_schema
        from lightllm.server.http.structured.structured_params import _regex
        assert compile_json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}, "tools")
        assert _regex("<tool_call>\\\\{", "guided_regex")
        try:
            _regex("a[^\\\\s\\\\S]", "guided_regex")  # matches no text at all
        except APIError as error:
            assert error.param == "guided_regex", error.param
        else:
            raise AssertionError("a grammar that matches nothing was accepted")
        import sys
        assert sys.modules["torch"] is None
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
