"""Nemesis tests: ClickHouse, ZooKeeper and the network fail under a writer.

See docs/reliability.md."""
