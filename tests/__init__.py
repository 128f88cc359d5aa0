"""The test suite.

Hypothesis runs without per-example deadlines and without the "too slow"
health check: the suite shares two cores with real PostgreSQL, Redis and
Spark servers, and a slow example is not a wrong one.  Under CI (``CI=true``)
its examples are derived from each test's name (``derandomize``), so a CI
run is repeatable; locally they are random, to keep finding new cases.
"""
import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "replicator",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=os.environ.get("CI", "").lower() == "true",
)
settings.load_profile("replicator")
