"""Running bucket exchanges off the backward path: one worker thread, in submission order.

A compressed bucket's exchange is compute (encode, decode, the owner's sum) around two collectives;
done inside the gradient hook it would stall backward for all of it. ``ExchangeWorker.submit``
hands the job to a single background thread and returns at once, so backward goes on computing
earlier layers' gradients while the bucket is encoded and sent. One thread keeps the collectives
of every rank in the same order (jobs run in submission order, and the reducer submits buckets
in index order); while the worker is in use, every DP collective of the step is issued from it,
on a communicator of its own (``ps.dp_exchange_group``, the thread's lane: parallel/lanes.py), so
that it never shares one with the TP and CP collectives autograd issues meanwhile.

On an accelerator the jobs run on a side stream that first waits for an event recorded on the
submitting stream (the bucket's gradients are complete there), and ``drain`` makes the caller's
stream wait for the side stream, so the optimizer sees the results. Streams, events and the thread
come from parallel/streams.py (device-generic, and observed by the stream-order checker; the
thread binds the rank's device before its first job); on CPU there are no streams and the thread
alone provides the overlap (ATen kernels release the GIL).
"""
from __future__ import annotations

from concurrent.futures import Future

import torch

from parallel import streams
from parallel.lanes import EXCHANGE_LANE, enter_lane


class ExchangeWorker:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        # the thread is in the exchange lane: its collectives go on ps.dp_exchange_group
        self._worker = streams.SerialWorker("dp-exchange", self.device, initializer=enter_lane,
                                            initargs=(EXCHANGE_LANE,))
        self._futures: list[Future] = []
        self._stream = streams.side_stream("dp-exchange", self.device)

    def submit(self, fn, *args) -> Future:
        """Run ``fn(*args)`` on the worker after everything submitted before."""
        event = streams.record_event(streams.current_stream(self.device))
        future = self._worker.submit(self._run, fn, args, event)
        self._futures.append(future)
        return future

    def _run(self, fn, args, event):
        streams.wait_event(event, self._stream)
        with streams.use(self._stream):
            return fn(*args)

    def drain(self) -> list:
        """Wait for every submitted job; their results in submission order (the first error is
        raised after all jobs have finished, so no job is left running)."""
        futures, self._futures = self._futures, []
        results, error = [], None
        for f in futures:
            try:
                results.append(f.result())
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                error = error or exc
                results.append(None)
        if futures:
            streams.wait_stream(streams.current_stream(self.device), self._stream)
        if error is not None:
            raise error
        return results

    @property
    def stream(self) -> streams.Stream:
        """The side stream the jobs run on (a name only on CPU, where there are no streams)."""
        return self._stream

    @property
    def busy(self) -> bool:
        return bool(self._futures)

    def close(self) -> None:
        self._worker.close()
