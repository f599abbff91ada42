"""Is a client's process still making progress? Asked before its quiet lease lapses.

A client renews its lease from a Python thread; a call that holds the interpreter's lock
for long starves that thread although the client is alive. So a lease past its expiry is
checked against the client's process itself, from outside its interpreter: the process
state the kernel reports (``/proc/<pid>/stat``) on the client's node. Running or sleeping:
alive, the lease is kept. Stopped, traced, a zombie, gone, or another process under the
same pid: not alive, the lease lapses.
"""

from __future__ import annotations

import logging
import os

import ray

__all__ = ["ProcessLiveness", "process_holder", "process_state"]

logger = logging.getLogger("cpkv.liveness")

# States of /proc/<pid>/stat that mean the process makes progress.
_ALIVE_STATES = frozenset("RSDIWP")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: fields start after the last ')'.
    return text[text.rindex(")") + 2 :].split()


def process_state(pid: int, start: str | None) -> str:
    """The state letter of ``pid`` (``"gone"`` when it is not there, or when another process
    took its pid since it started at ``start``)."""
    fields = _stat_fields(pid)
    if fields is None:
        return "gone"
    if start is not None and fields[19] != start:
        return "gone"
    return fields[0]


def process_holder() -> dict:
    """This process as a lease holder: its node, pid and start time."""
    pid = os.getpid()
    fields = _stat_fields(pid)
    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "pid": pid,
        "start": None if fields is None else fields[19],
    }


@ray.remote(num_cpus=0, max_retries=0)
def _remote_state(pid: int, start: str | None) -> str:
    return process_state(pid, start)


class ProcessLiveness:
    """``probe(holder)``: True when the holder's process runs, False when it is stopped or
    gone, ``None`` when that could not be told (its node did not answer in time).

    Args:
        timeout_s: how long a probe on another node may take.
    """

    def __init__(self, timeout_s: float = 5.0) -> None:
        self._timeout_s = timeout_s
        self._node_id = ray.get_runtime_context().get_node_id()

    def __call__(self, holder: dict) -> bool | None:
        pid, start = int(holder["pid"]), holder.get("start")
        if holder.get("node_id") == self._node_id:
            state = process_state(pid, start)
        else:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            where = NodeAffinitySchedulingStrategy(holder["node_id"], soft=False)
            try:
                state = ray.get(
                    _remote_state.options(scheduling_strategy=where).remote(pid, start),
                    timeout=self._timeout_s,
                )
            except Exception as e:  # the node is gone or slow: say so, decide nothing
                logger.info("liveness of pid %d on another node unknown: %s", pid, e)
                return None
        return state in _ALIVE_STATES
