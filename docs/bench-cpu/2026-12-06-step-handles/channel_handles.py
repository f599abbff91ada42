"""The channel's side of a compiled step: ``submit_steps`` and every read the coordinator
makes of its handles (done, exception, status, result), with lanes that answer at once.

Run from the repo root for the tree ("new": one future a step, ``StepHandles``), and with
``PYTHONPATH=<dir>`` holding ``git archive 3c22b85 cpkv`` for the base (a future a lane
and a wrapper future each). Prints us a step, five repeats of 20000.
"""

import timeit
from concurrent.futures import Future
from pathlib import Path

import cpkv.coordinator.channel as channel
from cpkv.coordinator.channel import LaneChannel
from cpkv.core.steps import LaneReply, StepResult

NEW = "StepHandles" in Path(channel.__file__).read_text()
RESULT = StepResult(16, 0.0, 0.0, 0.0, "pass_q", 0)


class Lanes:
    def submit(self, lane, method, *args):
        future = Future()
        future.set_result(None)
        return future

    def result(self, handle, timeout):
        return handle.result()

    def done(self, handles):
        return [h.done() for h in handles]

    def execute_steps(self, packet):
        replies = [LaneReply(({"ok": True}, RESULT)) for _ in packet.fences]
        if NEW:
            future = Future()
            future.set_result(replies)
            return future
        out = []
        for reply in replies:
            future = Future()
            future.set_result(reply)
            out.append(future)
        return out


def one_step(ch: LaneChannel) -> None:
    handles = ch.submit_steps("step")
    assert all(f.done() for f in handles)
    assert all(f.exception() is None for f in handles)
    [f.result()[0] for f in handles]  # the coordinator settles the step by the statuses
    [f.result(1.0)[1] for f in handles]  # and answers the client the results


for cp in (1, 4):
    ch = LaneChannel(Lanes(), cp, "e", flush_after_s=60)
    for lane in range(cp):
        ch.new_generation(lane)
    n = 20000
    times = [timeit.timeit(lambda ch=ch: one_step(ch), number=n) / n * 1e6 for _ in range(5)]
    print("new" if NEW else "base", cp, " ".join(f"{t:.1f}" for t in times))
    ch.close()
