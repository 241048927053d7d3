"""The padded vocabulary in the planner's time and FLOPs: the engine allocates the output layer with
the vocabulary padded to a multiple of 128 x tp and computes those columns, so the logits' GEMMs,
the cross-entropy's passes and the executed FLOPs (HFU) count them; the model FLOPs (MFU) count
the model's own vocabulary, as the engine's measured MFU does."""
from __future__ import annotations

import pytest

from engine.plan.flops import logits_forward_flops, step_flops
from engine.plan.hardware import DEVICE_SPECS
from engine.plan.model import Cluster, Layout, ModelShape
from engine.plan.timing import _rates, estimate, layout_links, pipeline_ends

L, H, S, B = 2, 256, 128, 8
GPT2 = 50257                     # GPT-2's vocabulary
PADDED = {1: 50304, 2: 50432}    # by hand: the next multiple of 128 (tp 1) and of 256 (tp 2)
TOKENS = B * S


def shape(vocab: int = GPT2) -> ModelShape:
    return ModelShape(L, H, 4, vocab, S, B, fused_attention=True)


def cluster(devices: int = 1) -> Cluster:
    return Cluster.from_device(DEVICE_SPECS["a100-80gb"], devices)


@pytest.mark.parametrize("tp", [1, 2])
def test_executed_flops_count_the_padded_columns_and_model_flops_do_not(tp):
    lay = Layout(tp, 1, 1, micro_batch_size=B)
    est = estimate(shape(), cluster(tp), lay)
    plain = step_flops(B, S, L, H, GPT2, block="gpt2")
    columns = 3 * 2 * TOKENS * H * (PADDED[tp] - GPT2)    # forward and backward of the extra columns
    assert est.flops.model == plain.model
    assert est.flops.executed == plain.executed + columns
    assert est.flops.vocab_padding == columns and est.flops.recomputed == 0
    assert est.flops.executed == step_flops(B, S, L, H, PADDED[tp], block="gpt2").executed
    assert est.hfu > est.mfu


@pytest.mark.parametrize("tp", [1, 2])
def test_logits_time_is_the_padded_vocabulary(tp):
    """The output layer's three GEMMs and the cross-entropy's fp32 passes over the V_pad / tp
    columns of each rank; a model whose vocabulary already is V_pad takes exactly the same step."""
    c, lay = cluster(tp), Layout(tp, 1, 1, micro_batch_size=B)
    rate, mem_s = _rates(c)
    _, logits, _ = pipeline_ends(shape(), c, lay, layout_links(c, lay))
    gemm = logits_forward_flops(TOKENS, H, PADDED[tp]) / tp / rate
    assert logits.compute == pytest.approx(3 * gemm + mem_s(20 * TOKENS * PADDED[tp] / tp
                                                            + 3 * 4 * TOKENS * H), rel=1e-12)
    assert (logits.backward, logits.weight) == pytest.approx((2 * gemm, gemm), rel=1e-12)
    padded = estimate(shape(PADDED[tp]), c, lay)
    est = estimate(shape(), c, lay)
    assert est.step_time_s == padded.step_time_s
    assert est.flops.executed == padded.flops.executed and est.flops.model < padded.flops.model


def test_the_engine_model_runs_the_padded_columns(monkeypatch):
    """torch.utils.flop_counter on the engine's own GPT chunk of vocabulary 200 (allocated as 256)
    counts the planner's executed FLOPs; the model count is that less the 56 padded columns."""
    from tests.engine.plan import test_flops
    monkeypatch.setattr(test_flops, "VOCAB", 200)
    counted, cfg = test_flops.counted_step_flops(monkeypatch)
    b, s, layers, h = test_flops.BATCH, test_flops.SEQ, test_flops.LAYERS, test_flops.HIDDEN
    est = estimate(ModelShape(layers, h, 4, 200, s, b), cluster(),
                   Layout(1, 1, 1, micro_batch_size=b))
    assert est.flops.executed == counted
    assert est.flops.model == counted - 3 * 2 * b * s * h * (256 - 200)
