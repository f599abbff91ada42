"""A cp=1 lane's decode steps through DecodeGraphs equal the lane's general eager path.

In-process (no Ray): two workers with the same model and equal shards run the same steps, one
with decode graphs (recorded on a GPU, the same static-buffer step eagerly on the CPU) and one
without; logits, greedy samples and the K/V written must agree.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from cpkv.core.config import KVShape
from cpkv.core.steps import StepRequest, StepSequence
from cpkv.lanes.decode_graph import BATCH_BUCKETS, DecodeGraphs
from cpkv.lanes.shard import LaneShard
from cpkv.lanes.worker import LaneWorker
from cpkv.models import LlamaModel, ModelConfig
from cpkv.results import widen_logits

GPU = torch.cuda.is_available()
DEVICES = [pytest.param("cpu", id="cpu")] + (
    [pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)] if GPU else []
)
PAGE = 8


class Lane:
    """One in-process cp=1 lane: a shard and a worker over it."""

    def __init__(self, model: LlamaModel, device: str, graphs: bool) -> None:
        c = model.config
        kv = KVShape(c.num_layers, c.num_kv_heads, c.head_dim, c.dtype)
        self.shard = LaneShard(0, 64, PAGE, kv, device)
        self.worker = LaneWorker(0, 1, torch.device(device), model, decode_graphs=graphs)
        self.worker.init_group("g", "127.0.0.1", 0, "gloo", 10.0)
        self.step_id = 0

    def step(self, seqs: list[StepSequence], sample: bool = False):
        """The worker's result, its logits rows widened to fp32 as a client's are."""
        self.step_id += 1
        res = self.worker.step(
            self.shard, StepRequest(self.step_id, "g", tuple(seqs), sample=sample)
        )
        wide = {b: widen_logits(r, res.logits_dtype) for b, r in res.logits.items()}
        return dataclasses.replace(res, logits=wide, logits_dtype="float32")


def seq(pages: list[int], prefix: int, tokens: list[int]) -> StepSequence:
    need = -(-(prefix + len(tokens)) // PAGE)
    return StepSequence(prefix, len(tokens), np.array(pages[:need]), np.array(tokens))


@pytest.fixture(params=DEVICES)
def lanes(request):
    device = request.param
    dtype = "float32" if device == "cpu" else "bfloat16"
    config = ModelConfig.tiny(dtype=dtype, max_position_embeddings=512)
    model = LlamaModel.random(config, seed=0, device=device)
    return Lane(model, device, graphs=True), Lane(model, device, graphs=False), device


def test_graph_decode_equals_the_eager_path(lanes):
    graph, eager, device = lanes
    tol = 1e-4 if device == "cpu" else 3e-2
    rng = np.random.default_rng(0)
    # Three requests on shuffled pages, prompts ending mid-page, on a page edge and early.
    pages = [list(rng.permutation(np.arange(1 + 20 * r, 21 + 20 * r))) for r in range(3)]
    lens = [13, 16, 5]
    prompts = [list(rng.integers(0, 97, n)) for n in lens]
    for lane in (graph, eager):
        lane.step([seq(pages[r], 0, prompts[r]) for r in range(3)])
    # Batches of 3 (bucket 4: a padding row), then 1, then 2 (buckets 1 and 2); decode crosses
    # page edges on the way.
    toks = [int(t) for t in rng.integers(0, 97, 3)]
    for batch in ([0, 1, 2], [0, 1, 2], [1], [2, 0], [0, 1, 2], [0, 1, 2], [0, 1, 2]):
        seqs = [seq(pages[r], lens[r], [toks[r]]) for r in batch]
        got, want = graph.step(seqs), eager.step(seqs)
        assert got.graph == (device == "cuda") and not want.graph
        for b in range(len(batch)):
            np.testing.assert_allclose(got.logits[b], want.logits[b], atol=tol, rtol=tol)
        for b, r in enumerate(batch):
            toks[r] = int(np.argmax(want.logits[b]))
            lens[r] += 1
    # Every page but the reserved one, where padding rows write.
    for layer in range(len(graph.shard.k)):
        for a, b in ((graph.shard.k, eager.shard.k), (graph.shard.v, eager.shard.v)):
            torch.testing.assert_close(a[layer][1:], b[layer][1:], atol=tol, rtol=tol)
    assert graph.worker._decode_graphs.num_recorded == 3
    assert eager.worker._decode_graphs is None


def test_sampling_steps_answer_ids_only(lanes):
    graph, eager, _ = lanes
    prompt = [5, 6, 7, 8, 9]
    pages = list(range(1, 9))
    for lane in (graph, eager):
        lane.step([seq(pages, 0, prompt)])
    want = eager.step([seq(pages, 5, [3])])
    got = graph.step([seq(pages, 5, [3])], sample=True)
    assert got.logits == {} and got.next_tokens == {0: int(np.argmax(want.logits[0]))}
    following = [seq(pages, 6, [got.next_tokens[0]])]
    eager_sampled = eager.step(following, sample=True)
    assert eager_sampled.logits == {}
    want_next = graph.step(following)  # logits of the same step, through the graph
    assert eager_sampled.next_tokens == {0: int(np.argmax(want_next.logits[0]))}


def test_graphs_take_decode_steps_only():
    one = [StepSequence(4, 1, np.array([1]), np.array([3]))]
    assert DecodeGraphs.accepts(one)
    assert not DecodeGraphs.accepts([StepSequence(4, 2, np.array([1]), np.array([3, 4]))])
    assert not DecodeGraphs.accepts([StepSequence(4, 1, np.array([1]))])  # no token ids
    assert not DecodeGraphs.accepts(one * (BATCH_BUCKETS[-1] + 1))


def test_a_new_shard_gets_new_graphs(lanes):
    """The graphs write the shard's tensors in place: a shard re-made at a reset (another
    size) must not be written through graphs recorded over the old one."""
    graph, _, device = lanes
    prompt, pages = [5, 6, 7], list(range(1, 9))
    graph.step([seq(pages, 0, prompt)])
    graph.step([seq(pages, 3, [1])])
    old = graph.worker._decode_graphs
    assert old is not None and old.k_cache[0] is graph.shard.k[0]
    c = graph.worker.model.config
    graph.shard = LaneShard(
        0, 32, PAGE, KVShape(c.num_layers, c.num_kv_heads, c.head_dim, c.dtype), device
    )
    graph.step([seq(pages, 0, prompt)])
    graph.step([seq(pages, 3, [1])])
    new = graph.worker._decode_graphs
    assert new is not old and new.k_cache[0] is graph.shard.k[0]
    assert new.num_pages == 32
    graph.worker.drop_decode_graphs()  # what a lane's reset to another size does first
    assert graph.worker._decode_graphs is None


@pytest.mark.parametrize(
    ("pages", "prefix", "match"),
    [
        ([1, 0], 8, "reserved"),
        ([1, 2, 3], 8, "needs 2 pages"),
        ([1, 1], 8, "more than once"),
        ([1, 64], 8, "past the shard"),
    ],
    ids=["reserved-page", "page-count", "page-twice", "past-the-shard"],
)
def test_graph_steps_refuse_bad_pages_like_the_eager_path(lanes, pages, prefix, match):
    graph, _, _ = lanes
    bad = StepSequence(prefix, 1, np.array(pages), np.array([3]))
    with pytest.raises(ValueError, match=match):
        graph.step([bad])
