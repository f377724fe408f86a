"""Prefect tasks: load_run, provision_sandbox, agent_turn, teardown, settle."""
