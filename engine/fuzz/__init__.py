"""``python -m engine.fuzz``: random valid layouts, each trained against the serial run.

Owns the space of layouts the equivalence property covers (space.py: drawn constructively, so
every draw is valid), the pool of rank processes that trains case after case under the
stream-order checker (pool.py), the verdict against the serial reference (compare.py) and the
command line (cli.py); with ``--screen`` also the features whose numerics differ from serial by
design (screen.py), judged by agreement, finite figures and loose bounds (compare.py).
docs/testing.md says how to run it before a release.
"""
