"""The device check's report: the markdown tables of every stage's results (also written as
``device_check.md`` beside the JSON)."""
from __future__ import annotations

from pathlib import Path

from benchmarks.common import markdown_table
from benchmarks.device_check.fp8 import fp8_lines
from benchmarks.device_check.moe import comparison_lines, syncs_lines
from benchmarks.device_check.offload import offload_lines
from benchmarks.device_check.plan import StageResult


def _pct(v):
    return "-" if v is None else f"{100 * v:.1f}%"


def _gib(n):
    return None if n is None else n / 2 ** 30


def _num(v, spec):
    return "-" if v is None else format(v, spec)


def report(results: list[StageResult], header: dict) -> str:
    lines = [f"device_check: {header['device']} ({header['device_name']}), torch {header['torch']}, "
             f"Python {header['python']}; host memory available "
             f"{_num(_gib(header.get('host_memory_available')), '.1f')} GiB; budget "
             f"{header['budget_s']:.0f} s, took {header['wall_s']:.0f} s", ""]
    if "device_table" in header:   # what MFU and the FP8 targets are measured against
        entry = header["device_table"] or "none (unknown device)"
        lines[-1:-1] = [f"hardware table entry {entry}: "
                        f"dense peak bf16 {_num(header.get('peak_bf16_tflops'), '.0f')}, fp8 "
                        f"{_num(header.get('peak_fp8_tflops'), '.0f')} TFLOP/s; device memory free "
                        f"at start {_num(_gib(header.get('device_memory_free')), '.1f')} GiB"]
    stage_rows = [[r.name, r.status, _num(r.deadline_s, ".0f"), _num(r.wall_s, ".0f"), r.detail or "-"]
                  for r in results]
    lines += [markdown_table(["stage", "status", "deadline (s)", "wall (s)", "detail"], stage_rows), ""]
    kern = next((r for r in results if r.kernels), None)
    if kern:
        lines += [markdown_table(["op", "device path", "forward err", "gradient err", "within tolerance"],
                                 [[k["op"], k["path"], _num(k["forward"], ".2e"), _num(k["gradient"], ".2e"),
                                   "yes" if k["ok"] else f"NO ({k['error']})" if k.get("error") else "NO"]
                                  for k in kern.kernels]),
                  "", "errors: max |device - reference| / max(1, max |reference|)", ""]
    if kern and kern.gemm_chunks:
        lines += [markdown_table(["tp chunks", "plain GEMM (ms)", "chunked GEMMs (ms)", "ratio",
                                  "max err"],
                                 [[str(g["tp"]), f"{g['plain_ms']:.3f}", f"{g['chunked_ms']:.3f}",
                                   f"{g['ratio']:.3f}", f"{g['max_err']:.1e}"] for g in kern.gemm_chunks]),
                  "", "--tp-comm-overlap's decomposition on one device: one TP rank's column GEMM "
                      "cut into tp sequence chunks against the plain GEMM (device time, median)", ""]
    two = next((r.two_ranks for r in results if r.two_ranks and r.two_ranks.get("rows")), None)
    if two:
        lines += [markdown_table(["two processes, one device (gloo)", "status",
                                  "largest relative loss difference vs serial", "note"],
                                 [[row["layout"], row["status"], _num(row["loss_rel_diff"], ".1e"),
                                   row["note"]] for row in two["rows"]]),
                  "", "Each layout trained as two processes on the one device against the serial "
                      "run on it (fp32, docs/design.md's 1e-4); a layout gloo cannot run says "
                      "which collective it refused.", ""]
    pair = next((r.tp_overlap for r in results if r.tp_overlap and r.tp_overlap.get("rows")), None)
    if pair:
        lines += [markdown_table(["tp=2 with SP", "tokens/s", "exposed TP (s per step)"],
                                 [[row["run"], _num(row["tokens_per_s"], ".0f"),
                                   _num(row["time_tp_exposed_s"], ".4f")] for row in pair["rows"]]),
                  "", f"--tp-comm-overlap on one device pair: overlap / plain tokens/s = "
                      f"{_num(pair.get('ratio'), '.3f')}; largest relative loss difference over "
                      f"the steps {_num(pair.get('loss_rel_diff'), '.1e')}", ""]
    runs = [r for r in results if r.summary]
    if runs:
        lines.append(markdown_table(
            ["run", "steps timed", "tokens/s", "TFLOP/s per device (model)", "MFU", "HFU",
             "step time (s)", "fwd+bwd / DP finish / optimizer (s)", "host syncs (most in a step)",
             "peak memory (GiB)"],
            [[r.name if r.status == "ok" else f"{r.name} ({r.status}: not finished)",
              str(r.summary["steps"]), _num(r.summary["tokens_per_s"], ".0f"),
              _num(r.summary["model_tflops_per_device"], ".1f"), _pct(r.summary["mfu"]),
              _pct(r.summary["hfu"]), _num(r.summary["step_time_s"], ".3f"),
              " / ".join(_num(r.summary[k], ".3f") for k in
                         ("time_forward_backward_s", "time_dp_finish_s", "time_optimizer_s")),
              _num(r.summary.get("host_syncs_per_step"), "d"),
              _num((r.summary["peak_memory_bytes"] or 0) / 2**30, ".1f")] for r in runs]))
        lines += ["", f"model: {header['model']} (moe, moe_dense: benchmarks/device_check/moe.py; offload: "
                      f"benchmarks/device_check/offload.py); totals "
                      f"over the steps after the warm-up ({header['warmup']} steps left out); MFU "
                      f"against the dense peak of engine/plan/hardware.py.", ""]
        lines += comparison_lines(results, header, Path(header.get("out", ".")),
                                  header.get("tiny", False), header.get("micro_batch", 4),
                                  header.get("global_batch", 16))
        lines += offload_lines(results)
    lines += fp8_lines(results) + syncs_lines(next((r.syncs for r in results if r.syncs), []))
    return "\n".join(lines)
