-- The privileges txsink needs. Replace `analytics` with your target database.
CREATE ROLE IF NOT EXISTS txsink_writer;

-- targets: write, read back counts, receive partitions moved from staging
GRANT SELECT, INSERT ON analytics.* TO txsink_writer;
GRANT ALTER MOVE PARTITION, ALTER ATTACH PARTITION ON analytics.* TO txsink_writer;

-- staging: the writer owns every table in it
GRANT CREATE TABLE, DROP TABLE, SELECT, INSERT, ALTER MOVE PARTITION, SYSTEM MERGES
    ON txsink_staging.* TO txsink_writer;

-- introspection used for validation, publish bookkeeping and `txsink status/verify`
GRANT SELECT ON system.parts TO txsink_writer;
GRANT SELECT ON system.tables TO txsink_writer;
GRANT SELECT ON system.columns TO txsink_writer;
GRANT SELECT ON system.merge_tree_settings TO txsink_writer;

CREATE USER IF NOT EXISTS txsink IDENTIFIED WITH sha256_password BY 'change-me'
    DEFAULT ROLE txsink_writer;
GRANT txsink_writer TO txsink;
