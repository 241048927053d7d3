"""The accelerator: the one place that knows about npu (torch_npu), cuda and cpu.

- ``runtime.py``: device type detection, binding each process to its device (LOCAL_RANK), the
  collective backend (hccl, nccl, gloo), TF32/HF32, the overflow check, the profiler API;
- ``chips.py``: the Ascend chip table (which fused torch_npu ops a chip runs, overflow mode);
- ``clock.py``: ``DeviceClock`` and ``EventPair``, device-time stamps on the current stream;
- ``syncs.py``: ``SyncCounter``, the host's waits for the device, counted per training step;
  ``sync_ops.py`` names the ops a GPU or NPU waits for (the count on CPU and NPU runs),
  ``native_syncs.py`` counts CUDA's own synchronizing-operation warnings (CUDA runs);
- ``compile.py``: torch.compile with the device's backend and its artifact cache;
- ``streams``: side streams, events, ``record_stream`` and device-bound worker threads, re-exported
  from ``parallel.runtime.streams``. The stream API lives in parallel/runtime/streams.py for
  layering reasons: parallel/ (the DP exchange worker, ZeRO-2's storage release, the pipeline
  watchdog) needs it and may not import engine/. The stream-order checker that tests install over it
  is ``parallel.runtime.stream_check`` (docs/streams.md).

Nothing outside this package calls ``torch.cuda`` or imports ``torch_npu`` for device control.
Imports only ``engine.base`` (and ``kernels.dispatch`` for the kernel paths,
``parallel.runtime.streams`` for the stream API).
"""
from parallel.runtime import streams  # noqa: F401 - the stream API, see above
