"""What crosses between ranks and what it costs: the communication layer's cost per call
(``call_cost``), the compressors' bytes and error (``compression_bytes``), data parallelism through
the trainer (``data_parallel``), tensor-parallel collectives per layer against the analytic count
(``tp_comm``), the TP overlap's tokens/s (``tp_overlap``), strong and weak scaling (``scaling``)."""
