"""`kvtier size`: sizing a pooled-memory appliance from a model, context, concurrency and traffic.

`hardware` (GPUs and fabrics), `planner` (what each tier must hold) and `capacity` (the report an
operator reads). Model shapes by name are `kvtier.model.catalog`, which the runtime uses too. The
runtime never imports this package.
"""
