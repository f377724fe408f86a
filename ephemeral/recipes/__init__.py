"""Recipes and suites: YAML files that declare prompts and a policy, expanded into runs
(docs/recipes.md).

- ``recipe``: loading (every problem at once) and expansion into runs.
- ``templates``: Jinja2 for recipes, sandboxed and bounded (not the HTML pages of
  ``ephemeral/templates/``).
- ``checks``: what a recipe expects of each of its runs, and their verdicts.
- ``datasets``: recipe datasets read by DuckDB (jsonl, csv, parquet), streamed in batches.
- ``prebuild``: environments made ready before anything runs in them.
"""
