"""Recipe runs and eval suites without Prefect: planning, money caps, verdicts, comparison, summary.

The flows (``flows/recipe_run.py``, ``flows/eval_suite.py``), ``ephemeral eval`` and
``ephemeral run RECIPE`` all call :func:`ephemeral.evals.suite.run_evaluation`; Prefect only
wraps it (subflow per run, artifacts). The modules, in the order a suite run uses them:

* ``plan``: what to run (:class:`~ephemeral.evals.plan.Evaluation` from a suite or recipe
  file, ``--model``/``--repeat``/``--filter``/``--limit``, the streamed plan);
* ``schedule``: the plan run under the money caps and the concurrency bound;
* ``execute``: one planned run admitted, run, judged and recorded;
* ``result``: one planned run's result and its pairing key;
* ``stats``: pass rates over graded runs, pass@k, the gate;
* ``compare``: the flips and cost delta against a previous suite run;
* ``report``: the report, its JSON and the content-free summary;
* ``render``: the pass table and the Markdown summary;
* ``store``: reports under ``<state>/evals``, earlier results from the records, retention;
* ``suite``: the whole evaluation end to end.

Money: a recipe (and a suite) has a cap like a run has. Before a run starts, its whole
``max_cost_micros`` is committed against every cap it falls under; when it settles, the
refund is given back, so a cap's committed amount is "worst case of the runs in flight plus
what finished runs were charged" and can never pass the cap. A run that does not fit waits
for runs in flight to settle; when nothing is in flight and it still does not fit, it is
skipped (``skipped``, reason ``budget``). A run whose settlement is unknown (an error after
admission) keeps its whole reservation committed.

Verdicts: every planned run ends in one outcome (``ephemeral.engine.outcomes``): ``pass`` when every
check of its recipe passes (a recipe without checks: when it succeeded), ``fail``, ``error``
(the infrastructure's: a sandbox that died or was wrecked, a failed setup, a provider or
internal failure, a refused admission), ``cancelled`` or ``budget`` (skipped or stopped for
money). Only pass and fail are graded: a recipe's pass rate is passes over graded runs, so an
infrastructure error never counts as the model's failure nor as its success. The runs that
were not graded are counted apart in the table and the export, and fail the gate on a line of
their own (a gate cannot pass on runs that never ran or were never judged).
"""
