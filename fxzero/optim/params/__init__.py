"""Params after the step: the all-gathers and the module hooks that wait for them, writes to params found, module buffers broadcast, rank 0's initial values."""
