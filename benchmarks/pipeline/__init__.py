"""Pipeline schedules and 3D layouts: each schedule's bubble in theory, simulation and measurement
(``bubble``), Gantt charts of schedules (``gantt``), dry runs of Narayanan et al.'s Table 1
(``dryrun_table1``)."""
