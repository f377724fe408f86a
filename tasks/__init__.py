"""Prefect tasks: reserve_budget, provision_sandbox, agent_turn, teardown, settle."""
