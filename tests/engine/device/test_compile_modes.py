"""engine/device/compile.py across grad modes: a compiled chunk keeps one graph per grad mode
(training, and evaluation under ``torch.no_grad``), and every chunk of a rank stays compiled in both.

- A tp=2 chunk with sequence parallelism traces as one graph with no graph break (``dynamo.explain``),
  then, compiled with Inductor, runs a training step, an evaluation forward and a second training
  step: one graph more for evaluation, no graph break, the training graph reused; the losses and
  gradients are the eager chunk's. Evaluation used to fail Dynamo's trace of the sequence-gathering
  linear (a ``*params`` Function inlined one argument off under no_grad), after which Dynamo
  skipped the chunk's forward for the rest of the process and compiled its pieces instead.
- Six one-layer chunks of one rank, training then evaluation: twelve entries of one code object,
  past Dynamo's default recompile limit (8), every one compiled (``compile_chunks`` raises the
  limit of its own calls) and the process's limit left as it was.

Counts are Dynamo's and Inductor's own (torch._dynamo.utils.counters), as in test_compile.py.
"""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from engine.device.compile import chunk_recompile_limit, compile_chunks
from models import GPTChunk, GPTConfig, LayerContext
from parallel.grid.state import ParallelState
from parallel.tensor_parallel import Initializer
from tests.engine.device.test_compile import CPU, compiled_counts

SP_CFG = dict(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=300,
              dropout=0.0)


def _sp_chunk(ps) -> torch.nn.ModuleList:
    cfg = GPTConfig(**SP_CFG)
    ctx = LayerContext(Initializer(0), sequence_parallel=True)
    return torch.nn.ModuleList([GPTChunk(cfg, ps, ctx, range(1))])


def _train_eval_train(chunks: torch.nn.ModuleList, tokens: torch.Tensor, counted: bool):
    """A training step's loss (forward and backward), an evaluation loss (eval mode, no_grad) and a
    second training step's loss; the gradients after both steps; with ``counted``, what Dynamo
    and Inductor had compiled after each of the three."""
    chunk, losses, counts = chunks[0], [], []

    def loss() -> torch.Tensor:
        return chunk(tokens[:, :-1], tokens[:, 1:]).mean()
    for train in (True, False, True):
        chunk.train(train)
        if train:
            value = loss()
            value.backward()
        else:
            with torch.no_grad():
                value = loss()
        losses.append(value.item())
        counts.append(compiled_counts() if counted else None)
    grads = {n: p.grad.clone() for n, p in chunks.named_parameters()}
    return losses, grads, counts


def _sp_chunk_in_both_modes(ps, run_dir):
    """On each tp rank: the explained graph of the training forward, then the eager and the
    compiled chunk through train, eval, train."""
    import torch._dynamo as dynamo
    torch._dynamo.reset()   # the pool's processes outlive a test: no entry or skip from another
    tokens = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    explained = dynamo.explain(_sp_chunk(ps)[0])(tokens[:, :-1], tokens[:, 1:])
    explain = (explained.graph_count, explained.graph_break_count,
               [str(b.reason) for b in explained.break_reasons])
    torch._dynamo.reset()
    eager = _train_eval_train(_sp_chunk(ps), tokens, counted=False)
    counters.clear()
    compiled = _train_eval_train(compile_chunks(_sp_chunk(ps), CPU, run_dir), tokens, counted=True)
    torch._dynamo.reset()
    return explain, eager, compiled


def test_tp2_sequence_parallel_chunk_compiles_one_graph_per_mode(tmp_path, monkeypatch):
    from parallel.grid.topology import RankGrid
    from tests.helpers.dist_utils import run_distributed
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    results = run_distributed(_sp_chunk_in_both_modes, grid=RankGrid(tp=2), args=(str(tmp_path),),
                              timeout_s=600)
    for (graphs, breaks, reasons), eager, compiled in results:
        assert (graphs, breaks) == (1, 0), reasons
        # dropout 0 and no update between: evaluation's forward (the sequence-gathering linears
        # without their Function) is the training forward, to the bit
        assert eager[0][1] == eager[0][0] == eager[0][2], eager[0]
        train, evaluated, train_again = compiled[2]
        assert (train["frames"], train["graphs"], train["breaks"]) == (1, 1, {}), train
        assert (evaluated["frames"], evaluated["graphs"], evaluated["breaks"]) == (2, 2, {}), evaluated
        assert train_again == evaluated, train_again   # the training graph reused, nothing new
        assert compiled[0] == pytest.approx(eager[0], rel=1e-6, abs=0)   # train, valid, train
        assert compiled[1].keys() == eager[1].keys()
        for name, g in eager[1].items():
            torch.testing.assert_close(compiled[1][name], g, rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"{name}: {m}")


def _one_layer_chunks(n: int) -> torch.nn.ModuleList:
    """``n`` one-layer chunks of a rank, as a pipeline's virtual stages: first, middle..., last."""
    from parallel.grid.state import ParallelState
    cfg = GPTConfig(num_layers=n, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=64, block="gpt2", dropout=0.0)
    return torch.nn.ModuleList([GPTChunk(cfg, ParallelState.serial(), LayerContext(Initializer(11)),
                                         range(i, i + 1)) for i in range(n)])


def test_without_the_compile_keyword_the_process_limit_is_raised(tmp_path, monkeypatch):
    """Before torch 2.12 (the 2.11 of a CUDA 13 machine), ``torch.compile`` takes no
    ``recompile_limit`` keyword: passing it was a TypeError at start. Where it is missing the
    process's limit is raised to the chunks' instead (torch.compile with 2.11's signature, doing
    the same work); where it exists it is passed and the process's limit is left alone."""
    import engine.device.compile as compile_mod
    n = 6
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(compile_mod, "compile_backend", lambda device_type: "eager")
    real = torch.compile

    def compile_2_11(model=None, *, fullgraph=False, dynamic=None, backend="inductor",
                     mode=None, options=None, disable=False):
        return real(model, fullgraph=fullgraph, dynamic=dynamic, backend=backend, mode=mode,
                    options=options, disable=disable)
    monkeypatch.setattr(torch, "compile", compile_2_11)
    with torch._dynamo.config.patch(recompile_limit=8):
        compile_chunks(_one_layer_chunks(n), CPU, tmp_path)   # (nn.Module.compile calls it now)
        assert torch._dynamo.config.recompile_limit == chunk_recompile_limit(n) > 8
    assert compile_mod.limit_options(20, compile_fn=real) == {"recompile_limit": 20}  # 2.13 here


def test_every_chunk_stays_compiled_in_both_modes(tmp_path, monkeypatch):
    """Six chunks x two grad modes = twelve entries of GPTChunk.forward's code, each its own graph;
    with Dynamo's default limit of 8 the last four evaluation calls used to run eagerly. Dynamo's
    own backend ("eager": traced, not code-generated) keeps it fast: the limit is Dynamo's."""
    import engine.device.compile as compile_mod
    n, seq = 6, torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(3))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(compile_mod, "compile_backend", lambda device_type: "eager")
    # torch's default, for this test only (Dynamo's own patch: a monkeypatch of the config
    # module's attribute would delete the setting on undo, as the module keeps no such attribute)
    with torch._dynamo.config.patch(recompile_limit=8):
        assert chunk_recompile_limit(n) == 2 * n + compile_mod.RECOMPILE_MARGIN
        torch._dynamo.reset()
        counters.clear()
        chunks = compile_chunks(_one_layer_chunks(n), CPU, tmp_path)
        for train in (True, False):
            chunks.train(train)
            with torch.set_grad_enabled(train):
                h = None
                for c in chunks:
                    h = c(seq[:, :-1] if c.pre_process else h, seq[:, 1:] if c.post_process else None)
            counts = compiled_counts()
            assert (counts["frames"], counts["graphs"], counts["breaks"]) == (
                n * (1 + (not train)),) * 2 + ({},), counts
        assert torch._dynamo.config.recompile_limit == 8   # the process's setting untouched
    torch._dynamo.reset()


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_packed_documents_of_any_count_are_one_graph(recompute):
    """A llama chunk compiled as compile_chunks compiles it (its recompile limit; Dynamo's eager
    backend: the guards are what is tested), fed six micro-batches of packed documents whose
    first row holds 1 to 6 documents: one graph under every recompute mode, each loss equal to
    the eager chunk's. Selective recompute handed the documents' host lengths to its checkpoint
    as arguments, a guard on their count: a graph per count, eager past the limit."""
    import kernels
    from models.batch import AttentionInputs
    cfg = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=64, seed=3, block="llama")
    chunks = [GPTChunk(cfg, ParallelState.serial(), LayerContext(Initializer(11), recompute=recompute),
                       range(1)) for _ in range(2)]
    chunks[1].load_state_dict(chunks[0].state_dict())
    chunks[1].compile(backend="eager", recompile_limit=chunk_recompile_limit(1))
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(0)
    for n in range(1, 7):
        cuts = sorted(torch.randperm(15, generator=g)[:n - 1].add(1).tolist())
        first = torch.tensor([sum(c <= t for c in cuts) for t in range(16)], dtype=torch.int32)
        ids = torch.stack([first, torch.zeros(16, dtype=torch.int32)])           # (2, 16)
        starts = [max([0] + [c for c in cuts if c <= t]) for t in range(16)]
        pos = torch.stack([torch.arange(16) - torch.tensor(starts), torch.arange(16)])
        inputs = AttentionInputs(pos, ids, kernels.cu_seqlens_from_document_ids(ids))
        tokens = torch.randint(0, 64, (2, 17), generator=g)
        eager, compiled = (c(tokens[:, :-1], tokens[:, 1:], inputs).mean() for c in chunks)
        compiled.backward()
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch._dynamo.reset()


def test_dropout_breaks_the_graph_as_the_start_note_says():
    """engine.train's note for --compile with dropout names 10 graphs for a 2-layer gpt2 chunk: the
    dropout streams (the trainer's ModelParallelRNG) save and restore the generator's state at each
    dropout site, which Dynamo does not trace. With dropout 0 the same chunk is one graph."""
    from parallel.grid.random import ModelParallelRNG
    graphs = []
    for dropout in (0.1, 0.0):
        ps = ParallelState.serial()
        cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8,
                        vocab_size=64, seed=3, block="gpt2", dropout=dropout)
        ctx = LayerContext(Initializer(11), rng=ModelParallelRNG.for_state(5, ps).trackers[0])
        chunk = GPTChunk(cfg, ps, ctx, range(2))
        chunk.compile(backend="eager", recompile_limit=chunk_recompile_limit(1))
        torch._dynamo.reset()
        counters.clear()
        g = torch.Generator().manual_seed(0)
        for _ in range(2):
            tokens = torch.randint(0, 64, (2, 9), generator=g)
            chunk(tokens[:, :-1], tokens[:, 1:]).mean().backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [10, 1], graphs
    torch._dynamo.reset()


def test_experts_in_a_loop_break_the_graph_as_the_start_note_says():
    """engine.train's note for --compile with MoE experts in a loop (fp16 on the CPU, fp32 on CUDA,
    --no-moe-grouped-gemm) names 14 graphs over 3 steps for a 2-layer MoE chunk, where the grouped
    GEMM gives 1: the loop reads each projection's row counts on the host."""
    from models import build_chunks
    from models.moe.stats import set_aux_grad_scale
    graphs = []
    for dtype in (torch.float16, torch.float32):
        cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8,
                        vocab_size=64, seed=3, block="gpt2", num_experts=4, moe_router_topk=2,
                        moe_ffn_hidden_size=16)
        chunks = build_chunks(cfg, ParallelState.serial(), LayerContext(Initializer(3, cfg.init_std)),
                              [range(2)], [0], 1)
        chunks[0].to(dtype).compile(backend="eager", recompile_limit=chunk_recompile_limit(1))
        torch._dynamo.reset()
        counters.clear()
        g = torch.Generator().manual_seed(0)
        for _ in range(3):
            set_aux_grad_scale(chunks, 1.0)
            tokens = torch.randint(0, 64, (2, 9), generator=g)
            chunks[0](tokens[:, :-1], tokens[:, 1:]).float().mean().backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [14, 1], graphs
    torch._dynamo.reset()
