"""Sync reward functions in worker processes that a timeout can kill (`reward.isolation`).

A sync reward function used to run in a worker thread: `asyncio.wait_for` stopped the WAIT at
`reward.timeout_s`, not the call, so a grader stuck on one answer (math-verify's sympy on a
pathological expression) kept its thread, and every retry took another, until the thread
pool was full and every later reward queued, timed out and failed its group. Here each call
runs in a worker process; a call past its deadline (or cancelled) kills that worker with
SIGKILL, which frees everything the call held, and a fresh worker is started for the next
call. Workers are started on demand, up to `size` (the reward's concurrency cap), and reused.

    pool = ProcessCallPool("my_rewards:grade", size=16)
    value = await pool.call(sample, timeout_s=30.0)   # TimeoutError: the worker is gone

A worker imports the function by its `module:function` path (it must be importable where the
pool runs, as for the thread path); a function's exception comes back as `RewardCallError`
with its type and message. A worker runs calls on its main thread, so libraries whose own
timeouts use SIGALRM (math-verify) can use them. A worker is a fresh interpreter
(`python -m rl_async.algo.reward_pool`) on the caller's import path, talking over a socket
pair: nothing of the caller (a Ray actor's threads, locks, its `__main__`) is inherited, which
multiprocessing's spawn would re-import.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any


class RewardCallError(RuntimeError):
    """The function raised inside its worker (the message names the exception type)."""


class WorkerLost(RuntimeError):
    """A worker process died under a call (killed by the OS, a crash in native code)."""


def _serve(path: str, conn: Connection) -> None:
    """A worker's loop: one argument in, ("ok", value) or ("error", text) out, until the
    caller's end of the pipe closes."""
    from rl_async.algo.rewards import load_callable

    fn = load_callable(path)
    while True:
        try:
            arg = conn.recv()
        except (EOFError, OSError):  # the pool closed (or its process died): exit
            return
        try:
            value = fn(arg)
            if inspect.isawaitable(value):
                value = asyncio.run(_awaited(value))
            conn.send(("ok", value))
        except Exception as exc:  # user code: reported to the caller, who retries or fails
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


async def _awaited(value):
    return await value


class _Worker:
    def __init__(self, path: str):
        mine, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rl_async.algo.reward_pool", path, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        theirs.close()  # the worker's end lives in the worker only: its death reads as EOF
        self.conn = Connection(mine.detach())

    async def call(self, arg: Any) -> Any:
        loop = asyncio.get_running_loop()
        reply: asyncio.Future = loop.create_future()

        def readable() -> None:
            loop.remove_reader(self.conn.fileno())
            try:
                result = self.conn.recv()
            except (EOFError, OSError):
                try:  # its end of the socket closed: it has exited, or does in a moment
                    code = self.process.wait(1)
                except subprocess.TimeoutExpired:
                    code = None
                reply.set_exception(WorkerLost(f"the reward worker process died (exit code "
                                               f"{code}) during the call"))
                return
            reply.set_result(result)

        self.conn.send(arg)
        loop.add_reader(self.conn.fileno(), readable)
        try:
            status, value = await reply
        finally:  # cancelled or timed out: stop listening before the kill (a no-op otherwise)
            loop.remove_reader(self.conn.fileno())
        if status == "error":
            raise RewardCallError(value)
        return value

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(5)
        self.conn.close()


class ProcessCallPool:
    """`module:function` calls in up to `size` reusable worker processes; a call that times
    out, is cancelled or loses its worker takes its worker down with it."""

    def __init__(self, path: str, size: int):
        if size < 1:
            raise ValueError(f"ProcessCallPool size = {size}: needs at least one worker")
        self.path = path
        self._slots = asyncio.Semaphore(size)
        self._idle: list[_Worker] = []
        self.started = 0  # workers started (the first `size` and every replacement)
        self.killed = 0   # workers killed by a timeout or a cancellation

    async def call(self, arg: Any, timeout_s: float) -> Any:
        async with self._slots:
            worker = self._idle.pop() if self._idle else self._start()
            try:
                value = await asyncio.wait_for(worker.call(arg), timeout_s)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self.killed += 1
                worker.kill()
                raise
            except WorkerLost:
                worker.kill()
                raise
            except BaseException:  # the function raised in the worker: the worker is fine
                self._idle.append(worker)
                raise
            self._idle.append(worker)
            return value

    def _start(self) -> _Worker:
        self.started += 1
        return _Worker(self.path)

    def close(self) -> None:
        for worker in self._idle:
            worker.kill()
        self._idle.clear()

    def metrics(self) -> dict[str, float]:
        return {"reward/workers_started": float(self.started),
                "reward/workers_killed": float(self.killed)}


if __name__ == "__main__":  # a worker: python -m rl_async.algo.reward_pool PATH FD
    _serve(sys.argv[1], Connection(int(sys.argv[2])))
