"""Shared test settings: hypothesis runs derandomized so CI cannot flake."""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "sharpdraft",
    derandomize=True,
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile("sharpdraft")
