"""Which collective backend the lanes' group uses: a pure decision on the lanes' devices.

It is a decision of the core: the coordinator picks the backend before it builds a lane group,
so the coordinator's process never imports torch (:mod:`cpkv.lanes.comm` builds the group).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["choose_backend", "device_id"]


def device_id(info: dict) -> str:
    """A lane's device, named uniquely across the pool (lanes on one GPU share a name).

    Args:
        info: the lane's ``info()`` answer (``device``, ``node_id``, ``gpu_ids``).
    """
    if not info["device"].startswith("cuda"):
        return "cpu"
    return f"{info['node_id']}/cuda:{','.join(info['gpu_ids'])}"


def choose_backend(device_ids_per_lane: Sequence[str]) -> str:
    """Pick the collective backend for lanes on these devices.

    Args:
        device_ids_per_lane: one id per lane naming its device uniquely across the pool, e.g.
            ``"cpu"``, ``"cuda:3"``, a GPU UUID ``"GPU-…"``, or node-qualified
            ``"<node>/cuda:0"``. Ids must be globally meaningful: inside a Ray actor
            ``"cuda:0"`` is the actor's first *visible* GPU, so pass the physical id or UUID.
            An id whose device part is ``"cpu"`` or starts with ``"cpu:"`` is a CPU lane; any
            other id is a CUDA device. The part before the last ``"/"`` names the node; ids
            without one are on this node.

    Returns:
        ``"gloo"`` when any lane is on the CPU; ``"cuda_ipc"`` when every lane has a CUDA
        device and all are on one node (lanes packed on one GPU, which NCCL refuses, or on
        several GPUs of the node); ``"nccl"`` for CUDA lanes on several nodes. Lanes that share
        a GPU across nodes cannot happen; if ids say so, ``"gloo"``.

    Raises:
        ValueError: no lanes, or an empty id.
    """
    ids = [str(d).strip() for d in device_ids_per_lane]
    if not ids:
        raise ValueError("device_ids_per_lane is empty")
    if any(not d for d in ids):
        raise ValueError(f"device_ids_per_lane holds an empty id: {ids}")

    def is_cpu(d: str) -> bool:
        dev = d.rsplit("/", 1)[-1].lower()
        return dev == "cpu" or dev.startswith("cpu:")

    if any(is_cpu(d) for d in ids):
        return "gloo"
    nodes = {d.rsplit("/", 1)[0] if "/" in d else "" for d in ids}
    if len(nodes) == 1:
        return "cuda_ipc"
    return "nccl" if len(set(ids)) == len(ids) else "gloo"
