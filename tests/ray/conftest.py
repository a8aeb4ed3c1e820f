"""One shared local Ray cluster per test session, bound to 127.0.0.1."""

import os
from pathlib import Path

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    tests = str(Path(__file__).resolve().parent.parent)  # test helpers (chaos_rewards, ...)
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                                       "PYTHONPATH": path}})
    yield ray
    ray.shutdown()
