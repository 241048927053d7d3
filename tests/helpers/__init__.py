"""Helpers shared by the test folders (and the benchmarks that spawn ranks the same way):
``dist_utils`` spawns real gloo process groups and gathers what each rank returns;
``fault_worker`` and ``launch_probe`` are processes the launch and fault tests start under
torchrun; ``npu_fake`` stands in for torch_npu's documented kernels on the CPU."""
