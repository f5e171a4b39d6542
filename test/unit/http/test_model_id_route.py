"""``/v1/models/{model_id}``: a served name may hold '/', and registering that path type changes nothing at import.

The route's path type is a Starlette convertor, and Starlette keeps one table of them per process.
openai_routes.py registered it when imported, so importing the HTTP layer (a tool, a test, the
torch-free check) changed a table every app of the process shares; it is registered when the
OpenAI router is built, once however many routers are.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from fastapi.testclient import TestClient

from api_fakes import FakeManager, FakeServed, assert_error
from lightllm.server.http.app import create_app

ROOT = Path(__file__).resolve().parents[3]

# Run in a fresh interpreter: this test process has built routers already.
_IMPORT_THEN_BUILD = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, "test/unit")
    from starlette.convertors import CONVERTOR_TYPES
    before = sorted(CONVERTOR_TYPES)
    from lightllm.server.http.openai import openai_routes
    after_import = sorted(CONVERTOR_TYPES)
    from api_fakes import FakeManager
    endpoints = openai_routes.OpenAIEndpoints(FakeManager())
    endpoints.router()
    first = dict(CONVERTOR_TYPES)
    endpoints.router()
    added = sorted(set(CONVERTOR_TYPES) - set(before))
    print(json.dumps({"before": before, "after_import": after_import, "added": added,
                      "same_after_second_router": CONVERTOR_TYPES == first
                      and all(CONVERTOR_TYPES[name] is first[name] for name in first)}))
""")


def test_importing_the_routes_leaves_starlettes_convertors_alone_and_building_registers_one_once() -> None:
    done = subprocess.run([sys.executable, "-c", _IMPORT_THEN_BUILD], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["after_import"] == seen["before"]
    assert seen["added"] == ["lightllm_model_id"]
    assert seen["same_after_second_router"]


def test_a_served_name_with_slashes_is_one_model_id() -> None:
    served = FakeServed()
    served.served_model_names = [served.model_name, "org/family/model"]
    client = TestClient(create_app(FakeManager(served)), raise_server_exceptions=False)
    assert client.get("/v1/models/org/family/model").json()["id"] == "org/family/model"
    assert client.head("/v1/models/org/family/model").status_code == 200
    assert_error(client.get("/v1/models/org/family"), 404, "model", "model_not_found")
    # Never empty: /v1/models/ is no model route for any method (not a 405 advertising GET).
    assert_error(client.get("/v1/models/"), 404, None, "not_found")
    assert client.delete("/v1/models/").status_code == 404
