"""What the integration tests share: the CPU stand-in of CuPy and NCCL (tests/support) as a
fixture."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


@pytest.fixture
def fake(monkeypatch):
    """``nccl_fake`` installed for one test (four fake GPUs), undone afterwards; its
    ``Settings``, with the module itself as ``.module``."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
    try:
        import nccl_fake
    finally:
        sys.path.pop(0)
    monkeypatch.delenv("AXONDIST_DEBUG", raising=False)
    settings_ = nccl_fake.install(monkeypatch, device_count=4)
    settings_.module = nccl_fake
    return settings_
