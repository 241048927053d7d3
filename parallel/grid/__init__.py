"""The rank grid: which rank holds which part of the model, and the state built from it.

- topology.py: ``RankGrid``, the tp x cp x dp x pp arithmetic (pure Python, worked examples);
- expert_groups.py: the MoE folding of a stage's ranks into ETP, EP and EDP groups (pure Python);
- state.py: ``ParallelState``, the process groups of one rank, handed to every constructor;
- random.py: the model-parallel random streams (split and replicated dropout regions).
"""
