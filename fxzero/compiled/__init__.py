"""What compiled graphs call at run time: the ``fxzero::`` custom ops, the binding of a graph to the optimizer that owns its params, and the counting wrapper around each compiled forward."""
