"""Partitions from clean posteriors: order statistics over shards (select, radix select) and the
corpus-wide decisions applied per shard (decisions): pure numpy."""
