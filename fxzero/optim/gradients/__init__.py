"""Gradients from backward to the step: the readiness ledger, hooks and reduce-scatters, the reduced shards (norms, clipping), the p.grad views, accumulation."""
