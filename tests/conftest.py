"""Shared test settings: hypothesis runs derandomized so CI cannot flake; tiny models on one thread; one
thread per worker when the suite runs in parallel (pytest-xdist, ``-n``)."""

import os

import pytest
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


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: thread start-up and contention cost more than the work (16x slower with 2 threads
    on a busy machine). Modules that run tiny models use it with ``pytest.mark.usefixtures``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_configure(config):
    """A parallel worker (pytest-xdist sets ``PYTEST_XDIST_WORKER``) keeps to one thread, and so do the
    commands it starts: the workers already fill the cores, more threads would only contend for them."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)
