#!/usr/bin/env bash
# Seeds the sample table of examples/streams.toml, or adds 20 new orders if it exists.
#
#   bqemulator (scripts/services up exports these):
#     BIGQUERY_EMULATOR_HOST=http://127.0.0.1:9050 BIGQUERY_PROJECT_ID=test-project examples/seed.sh
#   Real BigQuery (same SQL, with the bq CLI):
#     bq query --project_id="$BIGQUERY_PROJECT_ID" --use_legacy_sql=false < examples/seed.sql
set -euo pipefail

host="${BIGQUERY_EMULATOR_HOST:?set BIGQUERY_EMULATOR_HOST (e.g. eval \"\$(scripts/services env)\"), or use bq for real BigQuery}"
project="${BIGQUERY_PROJECT_ID:-test-project}"
sql="$(cat "$(dirname "$0")/seed.sql")"

answer="$(jq -n --arg q "$sql" '{query: $q, useLegacySql: false}' |
	curl -sS --fail-with-body -X POST "${host%/}/bigquery/v2/projects/${project}/queries" \
		-H 'content-type: application/json' -d @-)"
if ! jq -e '(.errors // []) | length == 0' >/dev/null <<<"$answer"; then
	echo "seeding failed: $(jq -c '.errors' <<<"$answer")" >&2
	exit 1
fi
count="$(jq -n --arg q 'SELECT COUNT(*) FROM demo_shop.orders' '{query: $q, useLegacySql: false}' |
	curl -sS --fail-with-body -X POST "${host%/}/bigquery/v2/projects/${project}/queries" \
		-H 'content-type: application/json' -d @- | jq -r '.rows[0].f[0].v')"
echo "demo_shop.orders now holds ${count} rows"
