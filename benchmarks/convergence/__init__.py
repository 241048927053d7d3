"""Does a feature train what its reference trains: gradient compression against the uncompressed
all-reduce (``compression``), FP8 against bf16 (``fp8``), mixture of experts against dense, with
its dispatch throughput and load balance (``moe``)."""
