"""The tool-calling and JSON-schema examples of docs/SERVING.md run as written (official `openai` client) against
the 2048-token test server with auto tool choice, and print what they promise."""

import contextlib
import io
import re
from pathlib import Path

import pytest

from tests.harness import shared_long_server

pytestmark = pytest.mark.timeout(300)
DOC = Path(__file__).resolve().parents[1] / "docs" / "SERVING.md"


def example(name: str) -> str:
    blocks = re.findall(r"```python\n(# docs-example: (\S+)\n.*?)```", DOC.read_text(), re.DOTALL)
    code = {n: c for c, n in blocks}[name]
    assert "http://127.0.0.1:8000/v1" in code
    return code.replace("http://127.0.0.1:8000/v1", shared_long_server().http_url + "/v1")


def run(code: str) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(DOC), "exec"), {"__name__": "docs_example"})
    return out.getvalue().splitlines()


def test_tool_calling_example():
    first, second = run(example("tools"))
    assert first == "tool_calls get_weather ['city', 'unit']"
    assert second.startswith("True")  # the final answer is text


def test_json_schema_example():
    (line,) = run(example("json-schema"))
    assert line == "stop ['age', 'name']"
