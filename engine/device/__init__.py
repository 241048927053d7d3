"""The accelerator: the one place that knows about npu (torch_npu), cuda and cpu.

- ``runtime.py``: device type detection, binding each process to its device (LOCAL_RANK), the
  collective backend (hccl, nccl, gloo), TF32/HF32, the overflow check, the profiler API;
- ``chips.py``: the Ascend chip table (which fused torch_npu ops a chip runs, overflow mode);
- ``clock.py``: ``DeviceClock`` and ``EventPair``, device-time stamps on the current stream;
- ``compile.py``: torch.compile with the device's backend and its artifact cache.

Nothing outside this package calls ``torch.cuda`` or imports ``torch_npu`` for device control.
Imports only ``engine.base`` (and ``kernels.dispatch`` for the kernel paths).
"""
