"""A Ray head of its own for the `ray job submit` tests: loopback only, every port free-picked,
its own temp dir, torn down by process id.

Why not `ray stop`: in Ray 2.60 it walks every process on the machine and kills the ones whose
name looks like Ray's (raylet, gcs_server, ...), whatever cluster they belong to, so it would
also end other test sessions' clusters. Instead `ray start` runs in a new session (setsid):
the daemons it spawns stay in that session and the workers the raylet forks change only their
process group, so "same session id" names exactly this cluster. Job drivers run in a session
of their own (the job supervisor starts them with start_new_session) and are found by the
RAY_ADDRESS in their environment, which names this cluster's GCS port.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
START_TIMEOUT_S = 120
TERM_GRACE_S = 5  # a throwaway cluster: nothing to flush
KILL_GRACE_S = 10


@dataclass
class JobCluster:
    gcs_address: str     # 127.0.0.1:<port>, what drivers see in RAY_ADDRESS
    dashboard_url: str   # http://127.0.0.1:<port>, the job server (`ray job ... --address`)
    env: dict[str, str]  # environment for every `ray ...` CLI call against this cluster
    auth_token: str
    temp_dir: str

    def ray(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run the venv's `ray` CLI against this cluster from the repo root."""
        return subprocess.run([str(VENV_BIN / "ray"), *args], cwd=REPO, env=self.env,
                              capture_output=True, text=True, timeout=timeout)

    def client(self):
        from ray.job_submission import JobSubmissionClient

        # The token goes in explicitly: this process may not be in token mode itself.
        return JobSubmissionClient(self.dashboard_url,
                                   headers={"Authorization": f"Bearer {self.auth_token}"})


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _cluster_env(token: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_ADDRESS", "RAY_API_SERVER", "RAY_AUTH"))}
    env.update({
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        # Token auth, as Ray 2.60 defaults to, but with a token this test owns, passed in the
        # environment so nothing is read from or written to ~/.ray/auth_token.
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token,
        # The job's entrypoint is the plain `rl-async` console script, found on the PATH the
        # raylet (and so the job supervisor) inherits: the venv's bin first.
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    })
    return env


def _ours(session_id: int, gcs_address: str) -> list[int]:
    """Pids of this cluster's processes (same session) and of drivers attached to it."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue  # already dead, waiting for its parent to reap it
            if os.getsid(pid) == session_id:
                pids.append(pid)
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (ProcessLookupError, PermissionError, FileNotFoundError):
            continue
        if f"RAY_ADDRESS={gcs_address}".encode() in environ:
            pids.append(pid)
    return [p for p in pids if p != os.getpid()]


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait_gone(session_id: int, gcs_address: str, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := _ours(session_id, gcs_address)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def _stop(session_id: int, gcs_address: str) -> list[int]:
    """SIGTERM this cluster's processes, SIGKILL what is left after a grace period."""
    _signal_all(_ours(session_id, gcs_address), signal.SIGTERM)
    _signal_all(_wait_gone(session_id, gcs_address, TERM_GRACE_S), signal.SIGKILL)
    return _wait_gone(session_id, gcs_address, KILL_GRACE_S)


@pytest.fixture(scope="module")
def job_cluster():
    if not sys.platform.startswith("linux"):
        pytest.skip("the teardown finds the cluster's processes through /proc (Linux only)")
    # A short path: Ray's unix sockets live under it and AF_UNIX paths max out at 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="rlj", dir="/tmp")
    (gcs, dash, client, agent_http, agent_grpc, metrics, env_agent, node_mgr,
     obj_mgr) = _free_ports(9)
    token = secrets.token_hex(32)
    env = _cluster_env(token)
    cmd = [str(VENV_BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1",
           f"--port={gcs}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
           "--include-dashboard=true", "--num-cpus=4", f"--temp-dir={temp_dir}",
           f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent_http}",
           f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
           f"--runtime-env-agent-port={env_agent}", f"--node-manager-port={node_mgr}",
           f"--object-manager-port={obj_mgr}", "--min-worker-port=0", "--max-worker-port=0",
           "--disable-usage-stats"]
    start = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    session_id, gcs_address = start.pid, f"127.0.0.1:{gcs}"
    try:
        out, _ = start.communicate(timeout=START_TIMEOUT_S)
        if start.returncode != 0:
            pytest.fail(f"`ray start --head` exited {start.returncode}:\n{out[-4000:]}")
        yield JobCluster(gcs_address, f"http://127.0.0.1:{dash}", env, token, temp_dir)
    finally:
        if start.poll() is None:
            start.kill()
        left = _stop(session_id, gcs_address)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"processes of the test cluster survived SIGKILL: {left}"
