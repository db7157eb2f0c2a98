"""`kvtier size`: sizing a pooled-memory appliance from a model, context, concurrency and traffic.

`catalog` (model shapes by name), `hardware` (GPUs and fabrics), `planner` (what each tier must hold)
and `capacity` (the report an operator reads). The runtime never imports this package."""
