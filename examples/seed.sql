-- Sample source data for examples/streams.toml (GoogleSQL; runs on BigQuery and on bqemulator).
-- Idempotent set-up, then 20 NEW orders after the current highest id, updated "now": run it again
-- between producer runs to watch exactly the new rows get enqueued.
CREATE SCHEMA IF NOT EXISTS demo_shop;

CREATE TABLE IF NOT EXISTS demo_shop.orders (
  order_id    INT64,
  customer_id STRING,
  status      STRING,
  total       NUMERIC,
  items       ARRAY<STRUCT<sku STRING, qty INT64>>,
  updated_at  TIMESTAMP
);

INSERT INTO demo_shop.orders (order_id, customer_id, status, total, items, updated_at)
SELECT
  base.max_id + n,
  CONCAT('cust-', CAST(MOD(base.max_id + n, 7) AS STRING)),
  IF(MOD(base.max_id + n, 3) = 0, 'paid', 'open'),
  CAST(base.max_id + n AS NUMERIC) * 1.25,
  [STRUCT('sku-1' AS sku, n AS qty), STRUCT('sku-2' AS sku, 1 AS qty)],
  -- Several orders share each timestamp: the (timestamp, order_id) cursor keeps them all.
  TIMESTAMP_ADD(CURRENT_TIMESTAMP(), INTERVAL DIV(n, 4) MICROSECOND)
FROM (SELECT COALESCE(MAX(order_id), 0) AS max_id FROM demo_shop.orders) AS base,
     UNNEST(GENERATE_ARRAY(1, 20)) AS n;
