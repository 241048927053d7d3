"""Bucket exchanges on a side stream, issued from the thread that runs the step.

A compressed bucket's exchange is compute (encode, decode, the owner's sum) around collectives.
``ExchangeWorker.submit`` runs the job at once, from the gradient hook, on the side stream
"dp-exchange": the stream first waits for an event recorded on the submitting stream (the bucket's
gradients are complete there), the job's kernels and collectives queue on it, and the host returns
to backward. On an accelerator the device runs the exchange beside the rest of backward; ``drain``
makes the caller's stream wait for the side stream, so the optimizer sees the results.

Why not a worker thread: NCCL and HCCL require every rank to submit to concurrently used
communicators in one order. A second host thread issuing the DP collectives while autograd issues
TP, CP, EP and pipeline ones interleaves them by timing, differently on every rank (a deadlock, or
a hang in a collective no peer entered). From the step's own thread the submission order is the
program's order, the same on every rank (the suite compares the ranks' sequences:
parallel/runtime/stream_check.py ``submission_order_problem``). The jobs keep their own
communicators (``ps.dp_exchange_group``, the exchange lane: parallel/runtime/lanes.py), entered for
the job's duration.

On the CPU there are no streams: the job runs inline (gloo's asynchronous collectives still run on
gloo's threads, but the encode and decode are on the step's thread). The stream-order checker
treats "dp-exchange" as a stream of its own and proves the orderings above.
"""
from __future__ import annotations

import torch

from parallel.runtime import streams
from parallel.runtime.lanes import EXCHANGE_LANE, lane


class ExchangeWorker:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._stream = streams.side_stream("dp-exchange", self.device)
        self._results: list = []

    def submit(self, fn, *args):
        """Run ``fn(*args)`` now, on the side stream, ordered after the caller's stream so far;
        its result is kept for ``drain``."""
        streams.wait_event(streams.record_event(streams.current_stream(self.device)), self._stream)
        with streams.use(self._stream), lane(EXCHANGE_LANE):
            result = fn(*args)
        self._results.append(result)
        return result

    def drain(self) -> list:
        """The results of the jobs submitted since the last drain, in submission order; the
        caller's stream waits for the side stream."""
        results, self._results = self._results, []
        if results:
            streams.wait_stream(streams.current_stream(self.device), self._stream)
        return results

    @property
    def stream(self) -> streams.Stream:
        """The side stream the jobs run on (a name only on CPU, where there are no streams)."""
        return self._stream

    @property
    def busy(self) -> bool:
        return bool(self._results)

    def close(self) -> None:
        self._results = []
