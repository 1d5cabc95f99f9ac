"""Alembic migrations for the tracker database (run through ``swarm-tracker db``)."""
