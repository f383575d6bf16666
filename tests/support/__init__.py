"""Helpers of the test suite, in one place: imported as `support.<module>` (pyproject.toml puts tests/ on pytest's
path; scripts run directly, tests/engine/fuzz.py and benchmarks/, put it there themselves). No tests here."""
