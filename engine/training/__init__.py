"""The training loop, from the command line to the last step.

- ``launch.py``: ``python -m engine.train``'s main (configuration, start-up checks, exit codes);
- ``validate.py``: the pure start-up checks of a configuration against the launch, on every rank
  before any collective (with engine/config/unused_flags.py's notes on flags without effect);
- ``trainer.py``: ``Trainer`` builds the model chunks, optimizer, reducer, data and checkpointer
  and runs the loop (resume, validation, saves, metrics); ``run_data.py`` its data (the batches
  of a step, the validation loss),
  ``run_events.py`` its notes, stop signals and the records a checkpoint's publication waits for;
- ``step.py``: one optimizer step (the pipeline schedule, gradient statistics, the update);
- ``step_record.py``: the step's metrics record, resilience keys and the closing summary;
- ``lr_schedule.py``, ``loss_scaler.py``: the learning rate and the dynamic loss scaler.

Uses configuration, device, data, checkpoints, observation and the planner's FLOP counts; none of
those imports it.
"""
