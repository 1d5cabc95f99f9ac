"""What every service needs, written once: structured logs, metrics, layered config, key files, the
CLI shell, the grpcio adapter, sampling settings and the vocabulary.

Imports nothing from ``node``, ``tracker`` or ``gateway`` (an import-linter contract checks it).
"""
