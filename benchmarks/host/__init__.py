"""Time on one process, outside the model's arithmetic or beside it: a step's own overhead
(``step_overhead``), an MoE layer's host time against a dense one's (``moe_layer``), each kernel's
fused path against its reference (``kernels``), guarded steps (``resilience``), checkpoint saves
(``checkpoint``)."""
