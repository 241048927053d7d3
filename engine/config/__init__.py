"""Configuration and the command line: what a run is, as typed data.

- ``schema.py``: the dataclass configs (``RunConfig`` and its sections), validated in
  ``__post_init__``, and the choices they accept; ``parallel.py``: its parallel-layout section
  (``ParallelConfig``: the rank grid, schedule, ZeRO, expert parallelism, backend rules);
- ``flags.py``: how each field is presented as a flag (help, group, Megatron-LM spellings);
- ``megatron_answers.py``: one-line answers to Megatron-LM flags and values not built here;
- ``fields.py``: the table of user-settable fields shared by the command line and recipes;
- ``recipe.py``: YAML recipes (``--config``), checked against the fields' types;
- ``cli.py``: ``parse_args``, the flags over the recipe, as a ``RunConfig``;
- ``unused_flags.py``: the notes on flags that have no effect in a layout (engine.train says
  them at start, engine.plan for the layout it proposes).

Imports only ``engine.base`` and ``engine.data`` (its parsers of ``--data-path`` and ``--split``);
nothing here reads a checkpoint or starts a process group.
"""
