"""Deciding: the manager (the block index, policies, watermarks and the cascade) and the plans it
hands out; what a load costs against a recompute. No I/O here: see `kvtier.moving`."""
