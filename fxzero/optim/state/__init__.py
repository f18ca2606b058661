"""The wrapped optimizer's state: torch.optim's schema, this rank's pieces, whole states across ranks, and what an added param group carries over."""
