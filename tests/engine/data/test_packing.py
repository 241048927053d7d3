"""Packed documents (--reset-attention-mask, --reset-position-ids, --eod-mask-loss).

- The per-micro-batch metadata built from the tokens: worked examples of document ids, positions,
  varlen segments and the loss mask, and the unmasked-token count of a global batch.
- A batch of two packed documents gives the same per-token losses as the two documents run
  separately (gpt2 with learned positions, llama with RoPE and grouped-query attention), and not
  without the switches.
- The reported loss is the mean over the unmasked tokens of the whole global batch.
- Bad configurations fail before training: no end-of-document token, a user block whose forward
  cannot take the metadata.
"""
from __future__ import annotations

import pytest
import torch

from engine.base import ConfigError
from engine.config.cli import parse_args
from engine.data.packing import (PackingConfig, attention_inputs, count_loss_tokens, loss_mask,
                                 micro_batch)
from engine.training.trainer import Trainer
from engine.training.validate import validate_packing
from models import GPTChunk, GPTConfig, LayerContext
from models.blocks import takes_attention_inputs
from parallel.grid.launch import LaunchEnv
from parallel.grid.state import ParallelState
from parallel.tensor_parallel import Initializer

E = 9  # the end-of-document token of the worked examples
ALL = PackingConfig(E, reset_attention_mask=True, reset_position_ids=True, eod_mask_loss=True)


def test_metadata_of_a_worked_example():
    tokens = torch.tensor([[1, 1, 1, E, 2, 2, E, 3], [E, 4, 4, 4, 4, E, E, 5]])
    inputs = attention_inputs(tokens, ALL)
    assert inputs.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0], [0, 0, 1, 2, 3, 4, 0, 0]]
    assert inputs.document_ids.tolist() == [[0, 0, 0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1, 2, 3]]
    assert inputs.cu_seqlens == (0, 4, 7, 8, 9, 14, 15, 16)  # rows flattened, every row ends one
    assert loss_mask(tokens, E).tolist() == [[1, 1, 1, 0, 1, 1, 0, 1], [0, 1, 1, 1, 1, 0, 0, 1]]
    # each switch alone
    pos_only = attention_inputs(tokens, PackingConfig(E, reset_position_ids=True))
    assert pos_only.document_ids is None and pos_only.position_ids.tolist() == inputs.position_ids.tolist()
    mask_only = attention_inputs(tokens, PackingConfig(E, reset_attention_mask=True))
    assert mask_only.position_ids.tolist() == [list(range(8))] * 2 and mask_only.cu_seqlens == inputs.cu_seqlens
    assert attention_inputs(tokens, PackingConfig(E, eod_mask_loss=True)) is None
    # a micro-batch: inputs and shifted labels from (b, s+1) samples, metadata of the inputs
    mb = micro_batch(torch.cat([tokens, tokens[:, :1]], dim=1), ALL, loss_tokens=11)
    assert torch.equal(mb.tokens, tokens) and mb.labels[0, -1] == 1 and mb.loss_tokens == 11
    assert mb.loss_mask.sum() == 11 and mb.inputs.cu_seqlens == inputs.cu_seqlens
    plain = micro_batch(torch.cat([tokens, tokens[:, :1]], dim=1), None)
    assert plain.inputs is None and plain.loss_mask is None and plain.loss_tokens is None
    assert count_loss_tokens([torch.tensor([1, E, 2, 3]), torch.tensor([E, E, 1, 1])], [0, 1, 1], E) == 2 + 1 + 1
    with pytest.raises(ValueError, match="end-of-document token"):
        PackingConfig(None, eod_mask_loss=True)


def _model(block: str, groups: int | None = None) -> GPTChunk:
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=groups,
                    seq_length=16, vocab_size=32, block=block, seed=3)
    return GPTChunk(cfg, ParallelState.serial("cpu"), LayerContext(Initializer(3, 0.2)), range(2)).eval()


@pytest.mark.parametrize("block, groups", [("gpt2", None), ("llama", 2), ("llama", 1)])
def test_two_packed_documents_give_the_losses_of_each_alone(block, groups):
    model = _model(block, groups)
    gen = torch.Generator().manual_seed(0)
    doc_a, doc_b = torch.randint(0, E, (6,), generator=gen), torch.randint(0, E, (8,), generator=gen)
    eod = torch.tensor([E])
    sample = torch.cat([doc_a, eod, doc_b, eod]).unsqueeze(0)  # (1, 16): s = 15 inputs
    mb = micro_batch(sample, ALL)
    with torch.no_grad():
        packed = model(mb.tokens, mb.labels, mb.inputs)[0]  # (15,) per-token losses
        alone = [model(d[None, :-1], d[None, 1:])[0] for d in (torch.cat([doc_a, eod]),
                                                                   torch.cat([doc_b, eod]))]
        plain = model(mb.tokens, mb.labels)[0]
    keep = mb.loss_mask[0].bool()  # all but position 6, whose input is E and target doc_b[0]
    assert keep.tolist() == [True] * 6 + [False] + [True] * 8
    torch.testing.assert_close(packed[keep], torch.cat(alone), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain[keep], torch.cat(alone), rtol=1e-3, atol=1e-3)


ARGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", "1", "--mock-data", "--vocab-size", "12", "--no-progress",
        "--device", "cpu", "--peak-tflops", "1", "--lr-warmup-iters", "0"]


def test_reported_loss_is_the_mean_over_unmasked_tokens_of_the_global_batch():
    flags = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss",
             "--block", "llama", "--num-query-groups", "2"]
    trainer = Trainer(parse_args(ARGS + flags), launch=LaunchEnv())
    try:
        eod = trainer.data.train.eot_id
        samples = torch.stack([trainer.data.train[i] for i in trainer.sampler.global_batch(0)])
        mb = micro_batch(samples, trainer.packing)
        with torch.no_grad():
            per_token = trainer.chunks[0](mb.tokens, mb.labels, mb.inputs)  # (8, 16)
        keep = mb.tokens != eod
        assert 0 < (~keep).sum() < keep.numel() - 8  # the mock data does hold documents
        want = per_token[keep].mean().item()
        assert [b.loss_tokens for b in trainer._batches(0)] == [int(keep.sum())] * 4
        loss = trainer.train().records[0]["loss"]
        assert loss == pytest.approx(want, rel=1e-6)
        assert abs(loss - per_token.mean().item()) > 1e-4  # the masked mean is not the plain one
    finally:
        trainer.close()


class XOnlyBlock(torch.nn.Module):
    """A user block whose forward takes x alone."""
    position, final_norm, tie_embeddings = "rope", "rmsnorm", False

    def __init__(self, cfg, layer_idx, ps, ctx):
        super().__init__()

    def forward(self, x):
        return x


def test_bad_packing_configurations_fail_before_training():
    assert takes_attention_inputs(_model("gpt2").block_cls) and not takes_attention_inputs(XOnlyBlock)
    block = ["--block", "tests.engine.data.test_packing:XOnlyBlock"]
    for flag in ("--reset-attention-mask", "--reset-position-ids"):  # RoPE needs the positions
        with pytest.raises(ConfigError, match=f"{flag} needs per-token metadata.*forward\\(self, x, inputs=None\\)"):
            Trainer(parse_args(ARGS + block + [flag]), launch=LaunchEnv())
    Trainer(parse_args(ARGS + block + ["--eod-mask-loss"]), launch=LaunchEnv()).close()  # loss only
    with pytest.raises(ConfigError, match="need data with an end-of-document token"):
        validate_packing(parse_args(ARGS + ["--eod-mask-loss"]), eod_id=None)  # data without one
    assert validate_packing(parse_args(ARGS), eod_id=None) is None


def test_a_micro_batch_reaches_the_device_without_a_host_wait():
    """Every tensor of a packed micro-batch (tokens, labels, loss mask, positions, document ids)
    goes to the device as an asynchronous copy: from pageable memory CUDA's copy makes the host
    wait for the stream (memcpy_and_sync), which before the forward holds its launch until the
    previous step's update has run. The meta device stands in for the accelerator (nothing is
    pinned for it; on a GPU the source is pinned first: parallel/runtime/streams.py)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._to_copy.default and str(kwargs.get("device")) == "meta":
                self.seen.append(bool(kwargs.get("non_blocking", False)))
            return func(*args, **kwargs)

    tokens = torch.tensor([[5, E, 7, 8, E, 9, 10, 11]])
    mb = micro_batch(torch.cat([tokens, tokens[:, :1]], dim=1), ALL, loss_tokens=6)
    with Copies() as copies:
        moved = mb.to("meta")
    assert moved.tokens.is_meta and moved.inputs.position_ids.is_meta
    assert copies.seen == [True] * 5, copies.seen      # tokens, labels, mask, positions, documents
