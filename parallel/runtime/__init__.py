"""How collectives and side work run: what a device would order, refuse or wait for.

- comm.py: ``CommGroup``, every collective with backend rules, byte counters and observers;
- comm_monitor.py: what the collectives are counted and tracked by: wire bytes, events,
  counters, observers (``CommMonitor``), a rank's ``Activity``, an async handle's wait;
- backend_rules.py: what HCCL and NCCL refuse (dtypes, ops), checked before anything is sent;
- lanes.py: one communicator, one thread: which threads may issue on which group;
- streams.py: side streams, events and threads, device-neutral;
- stream_check.py: the stream-order checker (every read after the write it depends on), and
  op_accesses.py: what an op or a collective touches and where the code issued it;
- heartbeat.py: the liveness watchdog that names a stalled rank or group;
- module_attrs.py: switches that live on modules.
"""
