"""kvtier tiers: HBM, DRAM, pool and SSD implementations of `Tier`."""
