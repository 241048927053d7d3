"""This engine against other code on the same model, data and machine: PyTorch's own parallelism
(``compare``, with the GPT of ``native``), a plain PyTorch loop (``overhead``), and a previous
release of this tree (``release``)."""
