-- Staging database for txsink attach mode. Staging tables are named
-- tx_<job>_<hash>__<xid>__r<run>_p<partition>_a<attempt>_t<task attempt id>
-- and are created, moved from and dropped by the writer only.
CREATE DATABASE IF NOT EXISTS txsink_staging;
