"""engine/device/compile.py: a compiled chunk computes what the eager chunk computes (loss and every
gradient, fp32), stays the same module (type, parameter names), and a second compilation with the
same run directory reuses the artifacts the first one left in ``run_dir/compile_cache``.

"Compiled" is read from Dynamo's and Inductor's own counters (torch._dynamo.utils.counters), not
from the flag: the one-layer chunk is one frame traced into one graph with no graph break, which
AOTAutograd splits into a forward and a backward graph that Inductor compiles (two FX-graph cache
misses cold, two hits warm). A chunk that silently ran eager would count no frame and no graph.

Inductor is slow on small CPUs, so the model has one layer and the test compiles it twice in all:
once cold, once after resetting Dynamo (what a new process would see), where Inductor must report
FX-graph cache hits and no misses.
"""
from __future__ import annotations


import pytest
import torch
from torch._dynamo.utils import counters

from engine.device.compile import CACHE_DIRNAME, compile_backend, compile_chunks
from engine.device.runtime import DeviceInfo
from models import GPTChunk, GPTConfig, LayerContext
from parallel.grid.random import ModelParallelRNG
from parallel.grid.state import ParallelState
from parallel.tensor_parallel import Initializer

CPU = DeviceInfo("cpu", torch.device("cpu"), "gloo", "cpu")
CFG = dict(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=300,
           block="llama", dropout=0.0)


def _chunks() -> torch.nn.ModuleList:
    cfg = GPTConfig(**CFG)
    chunk = GPTChunk(cfg, ParallelState.serial(), LayerContext(Initializer(11)), range(1))
    return torch.nn.ModuleList([chunk])


def _loss_and_grads(chunks: torch.nn.ModuleList):
    seq = torch.randint(0, CFG["vocab_size"], (2, CFG["seq_length"] + 1),
                        generator=torch.Generator().manual_seed(3))
    loss = chunks[0](seq[:, :-1], seq[:, 1:]).mean()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in chunks.named_parameters()}


def _assert_same(got, want):
    assert got[0] == pytest.approx(want[0], rel=1e-6, abs=0)
    assert got[1].keys() == want[1].keys()
    for name, g in want[1].items():
        torch.testing.assert_close(got[1][name], g, rtol=1e-5, atol=1e-7,
                                   msg=lambda m: f"{name}: {m}")


def assert_compiled_one_graph(cache: str) -> None:
    """Dynamo traced the chunk's forward as one frame into one graph, without a graph break, and
    Inductor produced its forward and backward graphs (``cache``: both missed or both hit)."""
    assert dict(counters["frames"]) == {"total": 1, "ok": 1}, dict(counters["frames"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    assert counters["aot_autograd"]["ok"] == 1, dict(counters["aot_autograd"])
    assert counters["inductor"][cache] == 2, dict(counters["inductor"])  # forward and backward


def test_backend_per_device():
    assert compile_backend("cpu") == "inductor"
    assert compile_backend("cuda") == "inductor"
    with pytest.raises(ValueError, match="cpu and cuda"):
        compile_backend("mps")
    with pytest.raises(ValueError, match="inference graphs only"):
        compile_backend("npu")


def test_compiled_matches_eager_and_reuses_cache(tmp_path, monkeypatch):
    # compile_chunks configures Inductor for the process; give the variable back afterwards
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    torch._dynamo.reset()
    eager = _loss_and_grads(_chunks())

    counters.clear()
    chunks = _chunks()
    names = [n for n, _ in chunks.named_parameters()]
    compiled = compile_chunks(chunks, CPU, tmp_path)
    assert compiled is chunks and type(chunks[0]) is GPTChunk
    assert [n for n, _ in compiled.named_parameters()] == names  # checkpoints see the same names
    _assert_same(_loss_and_grads(compiled), eager)
    assert_compiled_one_graph("fxgraph_cache_miss")
    assert counters["inductor"]["fxgraph_cache_hit"] == 0
    cache = tmp_path / CACHE_DIRNAME
    assert any(cache.rglob("*")), "the first compilation must leave artifacts in the run dir"

    # the next run of the same recipe: Dynamo retraces, Inductor finds every graph on disk
    torch._dynamo.reset()
    counters.clear()
    again = compile_chunks(_chunks(), CPU, tmp_path)
    _assert_same(_loss_and_grads(again), eager)
    assert_compiled_one_graph("fxgraph_cache_hit")
    assert counters["inductor"]["fxgraph_cache_miss"] == 0
    torch._dynamo.reset()


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputed_layers_with_the_dropout_streams_compile(tmp_path, monkeypatch, recompute):
    """Recomputation with the run's dropout streams attached, as the trainer attaches them: the
    eager replay restores the streams' states around it (a context torch.compile does not take:
    it crashed the first compiled step), the compiled chunk checkpoints plainly and computes the
    eager chunk's loss and gradients (dropout 0; with dropout the run's validation refuses
    --compile with --recompute: tests/engine/training/test_bad_input.py)."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    ps = ParallelState.serial()

    def chunks():
        tracker = ModelParallelRNG.for_state(5, ps).trackers[0]
        ctx = LayerContext(Initializer(11), recompute=recompute, rng=tracker)
        return torch.nn.ModuleList([GPTChunk(GPTConfig(**CFG), ps, ctx, range(1))])
    torch._dynamo.reset()
    eager = _loss_and_grads(chunks())
    _assert_same(_loss_and_grads(compile_chunks(chunks(), CPU, tmp_path)), eager)
    torch._dynamo.reset()


def compiled_counts() -> dict:
    """What Dynamo and Inductor did since ``counters.clear()``: frames traced, graphs, Inductor's
    compiled FX graphs (cache hits and misses: ranks sharing a cache directory split them), and
    each graph break by the first line of its reason."""
    return {"frames": counters["frames"]["ok"], "graphs": counters["stats"]["unique_graphs"],
            "aot": counters["aot_autograd"]["ok"],
            "inductor": counters["inductor"]["fxgraph_cache_hit"]
            + counters["inductor"]["fxgraph_cache_miss"],
            "breaks": {reason.splitlines()[0]: n for reason, n in counters["graph_break"].items()}}


def _zb_h1_eager_and_compiled(ps, run_dir):
    """zb-h1 at pp=2 with and without --compile: (losses, grad norms, W closures run, what Dynamo
    and Inductor compiled) each."""
    from engine.config.cli import parse_args
    from engine.training.trainer import Trainer
    base = ["--mock-data", "--vocab-size", "256", "--no-progress", "--device", "cpu",
            "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--global-batch-size", "4", "--micro-batch-size", "2",
            "--train-iters", "3", "--precision", "fp32", "--lr", "1e-3", "--lr-warmup-iters", "0",
            "--peak-tflops", "1", "--pp", "2", "--pipeline-schedule", "zb-h1"]
    out = []
    for extra in ([], ["--compile", "--run-dir", run_dir]):
        counters.clear()
        trainer = Trainer(parse_args(base + extra))
        ran, run = [], trainer.weight_grads.run
        trainer.weight_grads.run = lambda key: ran.append(run(key)) or ran[-1]
        records = trainer.train().records
        trainer.close()
        out.append(([r["loss"] for r in records], [r["grad_norm"] for r in records], sum(ran),
                    compiled_counts()))
    return out


# Per stage of the compiled zb-h1 run: the graphs between the split linears (which run eagerly
# through apply_eager, a torch.compiler.disable'd function: the only graph break), each a forward
# for AOTAutograd and, with a backward, a second graph for Inductor.
ZB_H1_GRAPHS, ZB_H1_INDUCTOR_GRAPHS = 5, 8
DISABLED = "Skip calling `torch.compiler.disable()`d function"


def test_compiled_zero_bubble_chunks_defer_weight_gradients(tmp_path, monkeypatch):
    """Under --compile the split layers run outside the compiled graphs (torch.compiler.disable),
    so B still queues the weight gradients and W runs them: the same losses as eager. Dynamo's
    counters show what ran compiled: the eager run traced nothing; the compiled run traced the
    graphs between the split layers on every stage, Inductor compiled them, and every graph
    break is the disabled apply_eager."""
    from parallel.grid.topology import RankGrid
    from tests.helpers.dist_utils import run_distributed
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    results = run_distributed(_zb_h1_eager_and_compiled, grid=RankGrid(pp=2),
                              args=(str(tmp_path),), timeout_s=600)
    for eager, compiled in results:
        assert eager[2] > 0 and compiled[2] == eager[2]            # W ran the deferred GEMMs
        for got, want in zip(compiled[:2], eager[:2]):
            assert got == pytest.approx(want, rel=1e-6)
        assert eager[3] == {"frames": 0, "graphs": 0, "aot": 0, "inductor": 0, "breaks": {}}
        counts = compiled[3]
        assert (counts["graphs"], counts["aot"], counts["inductor"]) == (
            ZB_H1_GRAPHS, ZB_H1_GRAPHS, ZB_H1_INDUCTOR_GRAPHS), counts
        assert counts["frames"] > 0 and list(counts["breaks"]) == [DISABLED], counts
