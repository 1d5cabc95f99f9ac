"""Discrete-event simulator of a volunteer swarm (``swarm-sim run`` / ``compare``).

Modules, one job each:

``config``      scenario files (TOML) -> frozen dataclasses; unknown keys are errors
``events``      the simulated clock: a heap of timestamped callbacks
``hardware``    hardware profiles and the calibrated batch service-time model
``geography``   regions, inter-region RTTs, last-mile latency
``node``        one volunteer: shard, continuous-batching scheduler, uplink
``swarm``       joins (placement), churn (crash, graceful drain), coverage
``snapshots``   the tracker's SwarmSnapshot, cached between membership/load changes
``policies``    placement and routing: the tracker's real functions, and baselines
``session``     a request's Route Session and its phases
``gateway``     admission, route pools, frame relay, recovery
``workload``    Poisson (with bursts) or replayed-trace requests
``metrics``     counters, percentiles, Gini
``simulator``   wiring and the result dictionary
``report``      result.json and PNG plots

See docs/simulation.md for the model's assumptions and calibration.
"""
