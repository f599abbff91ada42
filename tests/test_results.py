"""Step results on the way back: a lane's logits rows travel in the model's dtype and reach
the client as the exact fp32 values the model computed (no Ray, no GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cpkv.core.steps import StepResult
from cpkv.lanes.worker import host_logits
from cpkv.results import decode_output, prefill_results, widen_logits

VOCAB = 131  # odd, so no row is a whole number of any vector width


def model_logits(dtype: torch.dtype, rows: int = 3) -> torch.Tensor:
    """fp32 logits as a model of ``dtype`` returns them: computed in its dtype, cast up."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, VOCAB, generator=g) * 30
    x[0, :4] = torch.tensor([float("inf"), float("-inf"), 0.0, -0.0])
    return x.to(dtype).float()


@pytest.mark.parametrize(
    ("dtype", "name", "itemsize"),
    [
        pytest.param(torch.bfloat16, "bfloat16", 2, id="bf16"),
        pytest.param(torch.float16, "float16", 2, id="fp16"),
        pytest.param(torch.float32, "float32", 4, id="fp32"),
    ],
)
def test_logits_rows_cross_in_the_models_dtype_and_widen_exactly(dtype, name, itemsize):
    logits = model_logits(dtype)
    rows, sent = host_logits(logits, dtype)
    assert sent == name and rows.itemsize == itemsize and rows.shape == (3, VOCAB)
    back = widen_logits(rows, sent)
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, logits.numpy())  # bit for bit, infinities included
    np.testing.assert_array_equal(np.signbit(back), np.signbit(logits.numpy()))


def test_a_nan_stays_a_nan_through_bf16_bits():
    logits = torch.full((1, VOCAB), float("nan")).to(torch.bfloat16).float()
    rows, sent = host_logits(logits, torch.bfloat16)
    assert np.isnan(widen_logits(rows, sent)).all()


def result(logits: dict, dtype: str) -> StepResult:
    return StepResult(1, 0.01, 0.0, 0.0, "pass_q", 0, logits=logits, logits_dtype=dtype)


def test_the_clients_answers_are_fp32_whatever_each_lane_sent():
    want = model_logits(torch.bfloat16, rows=2)
    bf16_rows, sent = host_logits(want, torch.bfloat16)
    # Two lanes each holding one request's last token (one of them answering fp32).
    results = [result({0: bf16_rows[0]}, sent), result({1: want[1].numpy()}, "float32")]
    out = decode_output(results, 2, probe=False)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, want.numpy())
    same = decode_output([result({0: bf16_rows[0], 1: bf16_rows[1]}, sent)], 2, probe=False)
    np.testing.assert_array_equal(same, want.numpy())
    allocs = [
        SimpleNamespace(extend_len=1),
        SimpleNamespace(extend_len=1),
    ]  # only the length is read
    made = prefill_results(allocs, results)
    for b in range(2):
        assert made[b].logits.dtype == np.float32
        np.testing.assert_array_equal(made[b].logits, want[b].numpy())
