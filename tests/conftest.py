"""Shared fixtures: recorded seeds for every randomized test, a server that takes tools."""

from __future__ import annotations

from pathlib import Path

import pytest
from server_fixture import Server

SEEDS = [0, 1, 7, 2026]


@pytest.fixture(scope="module")
def tool_server():
    """The embedded default behind a template that takes tools the Hermes way (tests/data), with
    the hermes parser."""
    template = Path(__file__).parent / "data" / "tools_template.jinja"
    s = Server("--chat-template", str(template), "--tool-call-parser", "hermes")
    yield s
    s.stop()
