"""Suite-wide fixtures: every test gets its own warm-start cache (`RL4BIT_CACHE_DIR`), so a warm start one
test trained is never a cache hit in another (and nothing is written to the user's ~/.cache)."""

import pytest


@pytest.fixture(autouse=True)
def _own_warm_start_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("RL4BIT_CACHE_DIR", str(tmp_path_factory.mktemp("rl4bit-cache")))
