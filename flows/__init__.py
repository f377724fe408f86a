"""Prefect flows: agent_run, recipe_run, eval_suite."""
