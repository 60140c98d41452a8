"""Ports: the I/O-free interfaces the protocol runner, ops and the Spark layer speak.

A port module imports neither clickhouse-connect, pyarrow, kazoo nor pyspark. Each port
ships an in-memory twin beside it (as :class:`txsink.keeper.registry.MemoryRegistry` is
for the registry) and a contract suite in ``tests/`` that the twin and every adapter pass.
"""
