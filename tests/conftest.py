from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `bench` and `tests` helpers import from the checkout

from core.storage import Storage  # noqa: E402

_ids = itertools.count()


@pytest.fixture(params=["local", "memory"])
def storage(request, tmp_path) -> Storage:
    """The same tests on a local directory and on fsspec's memory:// filesystem."""
    if request.param == "local":
        yield Storage(str(tmp_path / "run"))
        return
    s = Storage(f"memory://islands-test-{next(_ids)}")
    yield s
    if s.fs.exists(s.root):
        s.fs.rm(s.root, recursive=True)


@pytest.fixture
def mem() -> Storage:
    return Storage(f"memory://islands-mem-{next(_ids)}")


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory) -> str:
    """One prepared corpus cache for every end-to-end test of the session."""
    return str(tmp_path_factory.mktemp("corpus-cache"))
