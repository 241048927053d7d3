"""Memory per rank: a pipeline step's peak activations (``activation``), context parallelism's
activations and tokens/s by sequence length (``long_context``), ZeRO-3 against ZeRO-2 (``zero3``)."""
