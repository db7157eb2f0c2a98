"""Helpers the test modules share (imported as `support.<topic>`; tests/ is on the path). Fixtures
are in tests/conftest.py."""
