"""Prefect tasks: load_run, provision_sandbox, agent_turn or agent_command, teardown, settle."""
