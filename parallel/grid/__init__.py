"""The rank grid: which rank holds which part of the model, and the state built from it.

- topology.py: ``RankGrid``, the tp x cp x dp x pp arithmetic (pure Python, worked examples);
- expert_groups.py: the MoE folding of a stage's ranks into ETP, EP and EDP groups (pure Python);
- launch.py: ``LaunchEnv`` (where a process sits: torchrun or Slurm) and ``check_layout``;
- rendezvous.py: the meeting before the process groups (a stopped or disagreeing rank named);
- state.py: ``ParallelState``, the process groups of one rank, handed to every constructor;
- random.py: the model-parallel random streams (split and replicated dropout regions).
"""
