"""One conversion as a pipeline of named steps, each timed in the report.

    load -> reference -> upgrade -> fold -> type -> normalize -> analyze -> plan -> rewrite
         -> save -> validate [-> repair -> save -> validate] -> report -> publish

Data flows one way: each step (:mod:`~mixprec.pipeline.steps`) takes the results of earlier
steps it needs and returns its own; the runner (:mod:`~mixprec.pipeline.runner`) calls them in
order. The model is typed once (one ONNX shape inference) and every later step works on that
typed model. Analyses record their findings by stable node key and value name (see
:func:`mixprec.graphs.node_keys`), so a plan can be made and applied again on a clean copy of
the typed model (:meth:`Prepared.rewrite`, used by the accuracy search and the repair) without
reloading or re-inferring anything.
"""

from mixprec.pipeline.runner import ConversionResult, Prepared, convert_model, prepare

__all__ = ["ConversionResult", "Prepared", "convert_model", "prepare"]
