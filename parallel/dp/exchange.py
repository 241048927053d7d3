"""Running bucket exchanges off the backward path: one worker thread, in submission order.

A compressed bucket's exchange is compute (encode, decode, the owner's sum) around two collectives;
done inside the gradient hook it would stall backward for all of it. ``ExchangeWorker.submit``
hands the job to a single background thread and returns at once, so backward goes on computing
earlier layers' gradients while the bucket is encoded and sent. One thread keeps the collectives
of every rank in the same order (jobs run in submission order, and the reducer submits buckets
in index order); while the worker is in use, every DP collective of the step is issued from it.

On an accelerator the jobs run on a side stream that first waits for an event recorded on the
submitting stream (the bucket's gradients are complete there), and ``drain`` makes the caller's
stream wait for the side stream, so the optimizer sees the results. This uses only the
device-generic ``torch.Stream`` / ``torch.Event``; on CPU there are no streams and the thread alone
provides the overlap (ATen kernels release the GIL).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch


class ExchangeWorker:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[Future] = []
        self._stream = None
        if self.device.type not in ("cpu", "meta"):
            self._stream = torch.Stream(device=self.device)

    def submit(self, fn, *args) -> Future:
        """Run ``fn(*args)`` on the worker after everything submitted before."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dp-exchange")
        event = None
        if self._stream is not None:
            event = torch.Event(device=self.device)
            event.record()
        future = self._pool.submit(self._run, fn, args, event)
        self._futures.append(future)
        return future

    def _run(self, fn, args, event):
        if self._stream is None:
            return fn(*args)
        self._stream.wait_event(event)
        with self._stream:
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
        if error is not None:
            raise error
        if self._stream is not None and futures:
            done = torch.Event(device=self.device)
            done.record(self._stream)
            torch.accelerator.current_stream(self.device).wait_event(done)
        return results

    @property
    def stream(self):
        """The side stream the jobs run on (None on CPU, where there are no streams)."""
        return self._stream

    @property
    def busy(self) -> bool:
        return bool(self._futures)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
