-- The least privileges txsink needs. `docker-compose.yml` runs this file at first start
-- for the database `analytics`; elsewhere replace `analytics` with your target database.
CREATE DATABASE IF NOT EXISTS analytics;
CREATE ROLE IF NOT EXISTS txsink_writer;

-- targets: write (dedup mode), read back counts, receive partitions moved from staging
-- (MOVE PARTITION ... TO TABLE asks INSERT here). The publish of visibility=batch (the
-- default on one non-replicated MergeTree server), ATTACH PARTITION ALL FROM, asks ALTER
-- DELETE and INSERT here: ClickHouse has no ALTER ATTACH PARTITION privilege. ALTER DELETE
-- also allows ALTER TABLE ... DELETE and DROP PARTITION; without it, visibility=auto
-- publishes by MOVE (docs/modes.md#visibility).
GRANT SELECT, INSERT ON analytics.* TO txsink_writer;
GRANT ALTER MOVE PARTITION, ALTER DELETE ON analytics.* TO txsink_writer;
-- create_table=if_missing creates a missing target from the DataFrame's schema; leave
-- this out where tables are created by hand (the writer then fails naming the table)
GRANT CREATE TABLE ON analytics.* TO txsink_writer;

-- staging: the writer owns every table in it. ALTER covers what create_staging does to
-- protect a fresh staging table (REMOVE TTL, MODIFY SETTING) and the column catch-up
-- before a MOVE (ADD COLUMN) after the target gained a column. Dedup mode keeps its
-- seal table txsink_seals there (docs/modes.md#attempts-that-outlive-their-batch).
GRANT CREATE TABLE, DROP TABLE, SELECT, INSERT, ALTER ON txsink_staging.* TO txsink_writer;
-- dedup mode sends each block as INSERT ... SELECT FROM input(): a table function,
-- which ClickHouse allows to users holding CREATE TEMPORARY TABLE
GRANT CREATE TEMPORARY TABLE ON *.* TO txsink_writer;

-- introspection used for validation, publish bookkeeping and `txsink status/verify`
GRANT SELECT ON system.parts TO txsink_writer;
GRANT SELECT ON system.tables TO txsink_writer;
GRANT SELECT ON system.columns TO txsink_writer;
GRANT SELECT ON system.merge_tree_settings TO txsink_writer;
GRANT SELECT ON system.data_skipping_indices TO txsink_writer;
GRANT SELECT ON system.projections TO txsink_writer;
-- visibility=batch: the evidence of an ATTACH (read through merge(), which lists only the
-- log tables a user was granted)
GRANT SYSTEM FLUSH LOGS ON *.* TO txsink_writer;
GRANT SELECT ON system.query_log TO txsink_writer;

-- the writer's user; its password comes from the environment of whoever runs txsink
-- (TXSINK_PASSWORD or --password-file), never from a command line
CREATE USER IF NOT EXISTS txsink IDENTIFIED WITH sha256_password BY 'change-me'
    SETTINGS PROFILE 'txsink' DEFAULT ROLE txsink_writer;
GRANT txsink_writer TO txsink;
