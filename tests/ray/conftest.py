"""One shared local Ray cluster per test session, bound to 127.0.0.1."""

import os

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}})
    yield ray
    ray.shutdown()
