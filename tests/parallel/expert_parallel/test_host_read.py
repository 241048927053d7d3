"""The split sizes' host read (parallel/expert_parallel/host_read.py).

- One side stream per device for a model: the MoE layers built from one ``LayerContext`` share
  its reader, so they copy on the same stream (identity), made once per device however many
  layers there are (``streams.side_stream`` counted), and take one slot of torch's pooled
  streams, which ProcessGroupNCCL's communicators share, instead of one each. ``start`` takes no
  stream on the CPU, so the stream choice is checked through ``HostReader.stream`` with a device,
  which ``start`` calls on an accelerator. The stream is a high-priority one (on an accelerator,
  ``torch.Stream`` of priority -1: the pool no communicator takes).
- ``HostReader.start`` is left out of compiled graphs (``torch.compiler.disable``): a compiled
  caller breaks its graph at the call, and the read still returns its values.
"""
from __future__ import annotations

import importlib

import torch

from models.config import GPTConfig
from models.layers import LayerContext
from models.moe.layer import MoELayer
from parallel.grid.state import ParallelState
from parallel.runtime import streams
from parallel.tensor_parallel import Initializer

host_read = importlib.import_module("parallel.expert_parallel.host_read")


def _layer(index: int, ctx: LayerContext) -> MoELayer:
    cfg = GPTConfig(num_layers=8, hidden_size=16, num_attention_heads=2, seq_length=8,
                    vocab_size=64, seed=3, num_experts=4, moe_ffn_hidden_size=8)
    return MoELayer(cfg, ParallelState.serial(), ctx, f"layers.{index}.mlp", kind="gelu",
                    bias=False)


def test_every_moe_layer_of_a_model_reads_on_one_side_stream_per_device(monkeypatch):
    made = []
    real = streams.side_stream
    monkeypatch.setattr(streams, "side_stream",
                        lambda name, device, high_priority=False:
                        made.append((name, str(device), high_priority))
                        or real(name, device, high_priority))
    ctx = LayerContext(Initializer(3))
    readers = [_layer(i, ctx).host_reader for i in range(8)]
    for device in (torch.device("cpu"), torch.device("meta")):
        chosen = [r.stream(device) for r in readers for _ in range(2)]
        assert all(s is chosen[0] for s in chosen), chosen
        assert chosen[0].name == host_read.STREAM_NAME and chosen[0].device == device
    assert readers[0].stream("cpu") is not readers[0].stream("meta")   # one per device
    assert made == [(host_read.STREAM_NAME, "cpu", True), (host_read.STREAM_NAME, "meta", True)], made
    other = _layer(0, LayerContext(Initializer(3))).host_reader        # another model: its own
    assert other.stream("cpu") is not readers[0].stream("cpu") and len(made) == 3


def test_a_high_priority_side_stream_comes_from_the_pool_no_communicator_takes(monkeypatch):
    """On an accelerator ``side_stream`` makes a ``torch.Stream`` of priority -1 when asked (the
    high-priority pool: ProcessGroupNCCL takes its communicators' streams from the default one),
    else of the default 0; the reader's stream is a high-priority one. (No CUDA stream exists on
    this CPU: ``torch.Stream`` is recorded instead.)"""
    asked = []
    monkeypatch.setattr(torch, "Stream", lambda device, priority=0: asked.append((str(device), priority))
                        or object())
    streams.side_stream("plain", "cuda:0")
    streams.side_stream("urgent", "cuda:0", high_priority=True)
    host_read.HostReader().stream("cuda:1")
    assert asked == [("cuda:0", 0), ("cuda:0", -1), ("cuda:1", -1)]
    assert streams.side_stream("cpu", "cpu", high_priority=True).native is None and len(asked) == 3


def test_the_read_start_is_left_out_of_compiled_graphs():
    reader = host_read.HostReader()

    def step(t):
        read = reader.start(t)
        return t + 1, read

    graphs = []

    def counting(gm, inputs):
        graphs.append(gm)
        return gm.forward
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        out, read = torch.compile(step, backend=counting)(torch.arange(4))
        breaks = list(torch._dynamo.utils.counters["graph_break"])
    finally:
        torch._dynamo.reset()
    assert any("HostReader.start" in b and "torch.compiler.disable" in b for b in breaks), breaks
    assert torch.equal(out, torch.arange(1, 5)) and read.values() == [0, 1, 2, 3]
    assert graphs   # the rest of the caller still compiled
