"""Money, in integer micro-dollars everywhere (docs/architecture.md).

- ``amounts``: amounts as text and back (on screen and on the command line).
- ``pricing``: the price book (``price_book.yaml`` beside it): what a model call, a web request
  and a second of sandbox cost.
- ``budget``: a run's budget inside its reservation (worst-case holds before model calls).
"""
