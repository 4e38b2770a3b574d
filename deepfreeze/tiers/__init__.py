"""Storage tiers: where a version's shard is written and where its flush reads it from."""
