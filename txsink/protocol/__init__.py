"""The transaction protocol of txsink: states, records and pure decisions.

Nothing in this package performs I/O or imports kazoo, clickhouse-connect or pyspark.
The driver observes Keeper and ClickHouse, asks these functions what to do, and runs the
returned operations (see :mod:`txsink.transactor`).
"""
