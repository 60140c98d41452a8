"""Ports: the I/O-free interfaces the protocol runner, ops and the Spark layer speak.

A port module imports neither clickhouse-connect, pyarrow, kazoo nor pyspark. Each port
ships an in-memory twin beside it and a contract suite in ``tests/`` that the twin and
every adapter pass:

- :mod:`.registry` (the coordination store): twin :mod:`.registry_memory`, adapter
  :class:`txsink.keeper.kazoo_registry.KazooRegistry`, contract
  ``tests/registry_contract.py``;
- :mod:`.warehouse` (ClickHouse): twin :mod:`.warehouse_memory`, adapters
  :class:`txsink.clickhouse.warehouse.ClickHouseWarehouse` and
  :class:`txsink.clickhouse.shards.ShardedWarehouse`, contract
  ``tests/warehouse_contract.py``.
"""
