"""Prefect tasks: reserve, provision, model_step, shell_step, teardown, settle, record."""
