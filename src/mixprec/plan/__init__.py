"""Precision planning: what a plan is (`model`), what the planner knows of ops (`templates`),
the rules that decide each node (`rules`, with what they read of a node: `readings`), the planner
that walks the model with them (`planner`), the cast placement by cost (`placement`) and plan
files (`file`), the Q/DQ pair rule (`qdq_pairs`), the weights-only plan (`weights_only`) and the
estimated price of a plan (`estimate`).

Import from the modules: this package re-exports nothing.
"""
