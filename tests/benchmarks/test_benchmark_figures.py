"""The benchmarks' figures mean what their labels and docs/benchmarks.md say: the tensor-parallel
collectives counted through the communication layer equal the analytic count; the scaling page's
DP byte columns are the payload and the ring model, as in the code; the page's notes say where the
peak and the threads came from; the bubble's peak activations are MiB; the host-time benchmarks
run on the CPU and count the step's one host read; data_parallel measures after exactly one
warm-up step."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import torch.distributed as dist

from benchmarks.common import machine_note
from benchmarks.communication import scaling, tp_comm
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed

DOCS = (Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md").read_text()


def _section(title: str) -> str:
    start = DOCS.index(title)
    return DOCS[start:DOCS.index("\n## ", start + len(title))]


def _table_after(text: str, heading: str) -> list[list[str]]:
    """The cells of the first markdown table from ``heading`` on (header row first)."""
    rows = []
    for line in text[text.index(heading):].splitlines():
        if line.startswith("|"):
            if not set(line) <= set("|- "):
                rows.append([c.strip() for c in line.strip("|").split("|")])
        elif rows:
            break
    return rows


def test_tp_comm_measured_equals_analytic_tp2():
    """Every (SP, block, pass) row at tp=2, counted through ps.comm.observers."""
    a = argparse.Namespace(batch=1, seq=8, hidden=16, heads=2, vocab=32)
    rows = run_distributed(tp_comm.rows_for, grid=RankGrid(tp=2), args=(a,))[0]
    assert len(rows) == 8 and all(r.rstrip(" |").endswith("yes") for r in rows), "\n".join(rows)
    sp_backward = [r for r in rows if r.startswith("| 2 | yes |") and "| backward |" in r]
    assert len(sp_backward) == 2
    assert all("| 4 all_gather, 2 reduce_scatter | 4 all_gather, 2 reduce_scatter |" in r
               for r in sp_backward), sp_backward


def test_tp_comm_docs_state_the_sp_backward_regather():
    text = _section("## Tensor-parallel communication")
    rows = _table_after(text, "| tp | SP |")
    sp_back = [r for r in rows[1:] if r[1] == "yes" and r[2] == "backward"]
    assert sp_back and all(r[3] == "4 all_gather, 2 reduce_scatter" for r in sp_back), sp_back
    assert "the same wire bytes per rank (2(n-1)/n x 2S)" not in text
    # wire MiB per rank: SP backward is 1.5x the all-reduce backward of the same tp
    for tp in ("2", "4"):
        plain = next(r for r in rows[1:] if r[:3] == [tp, "no", "backward"])
        sp = next(r for r in rows[1:] if r[:3] == [tp, "yes", "backward"])
        assert float(sp[5]) == pytest.approx(1.5 * float(plain[5]), abs=2e-3)


def test_scaling_docs_byte_columns_are_what_the_code_prints():
    """The DP payload does not depend on dp; the ring model grows as 2(n-1)/n of it; the docs'
    headers are the code's."""
    headers = scaling.table([]).splitlines()[0]
    text = _section("## Scaling")
    assert "(ring model)." not in text.split("Recipe:")[0].split("DP payload")[0]
    for heading in ("### Strong scaling", "### Weak scaling"):
        rows = _table_after(text, heading)
        assert "| " + " | ".join(rows[0]) + " |" == headers
        col = {name: i for i, name in enumerate(rows[0])}
        by_layout = {r[col["layout (tp,pp,dp)"]]: r for r in rows[1:]}
        payload = {lay: by_layout[lay][col["DP payload per step"]]
                   for lay in ("(1,1,2)", "(1,1,4)", "(1,1,8)")}
        assert len(set(payload.values())) == 1, payload
        mib = lambda cell: float(cell.split()[0])  # noqa: E731
        for lay, factor in (("(1,1,2)", 1.0), ("(1,1,4)", 1.5), ("(1,1,8)", 1.75)):
            wire = mib(by_layout[lay][col["DP wire per step (ring model)"]])
            assert wire == pytest.approx(factor * mib(payload[lay]), abs=0.06), (lay, wire)


def _render(peak, peak_tflops=None, threads=1, device_type="cpu") -> str:
    args = argparse.Namespace(config=None, repeats=1, steps=3, warmup=1, modes=["strong"],
                              strong_batch=16, batch_per_dp=8, peak_tflops=peak_tflops,
                              threads_per_rank=threads)
    return scaling.render({"strong": []}, args, peak, 1, device_type)


def _peak_sentence(page: str) -> str:
    return re.search(r"MFU peak: [^\n]*?\.(?= |$)", page, re.M).group(0)


def test_scaling_page_says_where_the_peak_and_threads_came_from():
    table_peak = _render(None, device_type="cuda")
    assert "device table peak" in _peak_sentence(table_peak)
    assert "measured" not in _peak_sentence(table_peak)
    assert "nccl" in table_peak and "gloo" not in table_peak
    four = _render(0.2, threads=4)
    assert "4 threads x one thread's measured" in _peak_sentence(four)
    assert "(one thread, measured)" not in four
    assert "4 threads per rank" in four and "one thread per rank" not in four
    given = _render(5.0, peak_tflops=5.0)
    assert "given with --peak-tflops" in _peak_sentence(given)
    assert "measured" not in _peak_sentence(given)
    assert "one thread per rank" in machine_note(1) and "gloo" in machine_note(1)


def test_bubble_peak_activations_are_labelled_mib():
    from benchmarks.pipeline import bubble
    assert bubble.MIB == 2 ** 20 and "(MiB)" in bubble.PEAK_HEADER
    header = _table_after(_section("### Zero-bubble schedules against 1F1B"), "| schedule |")[0]
    assert "peak activations (MiB)" in header and "peak activations (MB)" not in DOCS


def _capture_device(monkeypatch, module):
    monkeypatch.setattr(module, "Trainer", lambda cfg: cfg)


def test_host_time_benchmarks_run_on_the_cpu(monkeypatch):
    from benchmarks.host import step_overhead
    from benchmarks.peers import overhead
    for module in (step_overhead, overhead):
        _capture_device(monkeypatch, module)
    so = argparse.Namespace(vocab_size=128, hidden_size=32, heads=2, seq_length=16,
                            micro_batch_size=2, precision="fp32")
    assert step_overhead.build(2, so).device == "cpu"
    po = argparse.Namespace(vocab_size=128, num_layers=1, hidden_size=32, heads=2, seq_length=16,
                            micro_batch_size=2, global_batch_size=2)
    assert overhead.engine_side(po).device == "cpu"


def test_step_overhead_counts_the_one_host_read_of_now():
    from benchmarks.host import step_overhead as so
    args = argparse.Namespace(vocab_size=64, hidden_size=16, heads=2, seq_length=8,
                              micro_batch_size=1, precision="fp16")
    counts = {}
    for name, fn, make in (("now", so.after_backward_now, so.build),
                           ("before", so.after_backward_before,
                            lambda n, a: so.as_before(so.build(n, a)))):
        trainer = make(1, args)
        for step in range(2):  # warm: the optimizer state exists
            local_loss, pipe = so.forward_backward(trainer, step)
            fn(trainer, local_loss, pipe, 1e-4)
        counts[name] = so.count_launches(trainer, fn, 2)
        trainer.close()
    assert counts["now"]["host_reads"] == 1          # the statistics' one tolist
    assert counts["now"]["host_scalar_reads"] == 0   # which aten::item alone does not see
    # before: the three .item() reads, the reduced loss's tolist, foreach AdamW's step counters
    assert counts["before"]["host_reads"] == counts["before"]["host_scalar_reads"] + 1 >= 4


def _dp_one_job(ps, args):
    from benchmarks.communication import data_parallel
    return data_parallel.run_rank(ps, [("scaling", data_parallel.flags(args, 1))])


def test_data_parallel_measures_after_one_warmup_step():
    """At --steps 2 one step is left after the one warm-up step: bytes and collectives are its."""
    args = argparse.Namespace(micro_batch_size=1, m=1, num_layers=1, hidden_size=32,
                              seq_length=16, steps=2)
    (row,) = run_distributed(_dp_one_job, grid=RankGrid(dp=1), args=(args,))[0]
    assert row["bytes"] == 0 and row["collectives"] == 0 and row["step_time"] > 0


def test_call_cost_bare_all_gather_is_the_call_commgroup_makes():
    from benchmarks.communication import call_cost
    assert call_cost._ALL_GATHER is dist.all_gather_single


def test_docs_data_parallel_and_compression_wording():
    dp = _section("## Data parallelism")
    assert "median of the steps after the first" not in dp and "summarize_run" in dp
    comp = _section("## Gradient compression: bytes, error and time")
    header = _table_after(comp, "| dp |")[0]
    assert "form" in header and "| onebit |" in comp and "top-k 1%" not in comp
    assert re.search(r"\| 2 \| topk 1% \| zero \|", comp)


def test_the_peer_comparison_runs_the_engine_on_the_native_sides_device(tmp_path):
    """The native side builds a CPU device mesh: the engine side must not pick an accelerator."""
    from benchmarks.common import parse_layout
    from benchmarks.peers import compare
    from engine.config.cli import parse_args
    argv = compare.engine_target(parse_layout("1,1,1"), {}, 2, tmp_path / "m.jsonl")
    assert parse_args(argv[argv.index("engine.train") + 1:]).device == "cpu"
