"""Hypothesis runs the same examples on every run and every machine: derandomized, with no example
database, so a property that fails in CI fails the same way locally, and passes the same way too.
Each test bounds its own ``max_examples``; no deadline, since a loaded CI machine is slow."""

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, deadline=None, max_examples=100)
settings.load_profile("ci")
