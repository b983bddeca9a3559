#!/usr/bin/env node
// The Graphile Worker contender of `outbox-bench peer` (tests/src/bin/outbox-bench/peer.rs).
//
// usage: node drain.js <database-url> <jobs> <payload-bytes>
//
// In the given database, installs the graphile_worker schema (the worker's own migrations), adds
// <jobs> no-op jobs with a <payload-bytes> string payload in bulk (addJobs, 5,000 per call: the
// chunk the outbox fill uses), VACUUM ANALYZEs the job table (as the outbox fill does, untimed),
// then runs a worker with the high-throughput settings of
// https://worker.graphile.org/docs/performance until every job is done, and prints one JSON line:
// {"jobs":N,"enqueue_per_s":..,"drain_per_s":..,"version":".."}. Diagnostics go to stderr.
"use strict";

const { EventEmitter } = require("node:events");
const { Logger, makeWorkerUtils, run } = require("graphile-worker");
const { version } = require("graphile-worker/package.json");

const CHUNK = 5000;

// Errors and warnings only: the default logger writes a line per completed job.
const logger = new Logger(() => (level, message) => {
  if (level === "error" || level === "warning") {
    process.stderr.write(`graphile-worker ${level}: ${message}\n`);
  }
});

// The settings of the performance page's benchmark ("Quick stats"), for this version's preset.
function workerPreset(connectionString, events) {
  return {
    worker: {
      connectionString,
      logger,
      events,
      concurrentJobs: 24,
      maxPoolSize: 25,
      // New jobs arrive by LISTEN/NOTIFY; the poll only matters for future/retried jobs.
      pollInterval: 2000,
      preparedStatements: true,
      // Batching: fetch (and lock) 500 jobs at a time, complete them in batches.
      localQueue: { size: 500 },
      completeJobBatchDelay: 0,
      failJobBatchDelay: 0,
    },
  };
}

function payload(i, bytes) {
  // A printable string that differs per job, so nothing is deduplicated or trivially compressed.
  const seed = `${i.toString(36)}-`;
  return { data: seed.repeat(Math.ceil(bytes / seed.length)).slice(0, bytes) };
}

async function enqueue(connectionString, jobs, bytes) {
  const utils = await makeWorkerUtils({ connectionString, logger });
  try {
    await utils.migrate();
    let spent = 0n;
    for (let start = 0; start < jobs; start += CHUNK) {
      const specs = [];
      for (let i = start; i < Math.min(jobs, start + CHUNK); i++) {
        specs.push({ identifier: "noop", payload: payload(i, bytes) });
      }
      const began = process.hrtime.bigint();
      await utils.addJobs(specs);
      spent += process.hrtime.bigint() - began;
    }
    await utils.withPgClient((client) =>
      client.query("VACUUM ANALYZE graphile_worker._private_jobs"),
    );
    return jobs / (Number(spent) / 1e9);
  } finally {
    await utils.release();
  }
}

async function drain(connectionString, jobs) {
  const events = new EventEmitter();
  let completed = 0;
  let failed = 0;
  let allDone;
  const done = new Promise((resolve) => {
    allDone = resolve;
  });
  events.on("job:failed", () => {
    failed += 1;
  });
  // Emitted once a job's outcome is handed to the (batched) completer; stop() flushes the batch.
  events.on("job:complete", () => {
    completed += 1;
    if (completed === jobs) allDone();
  });
  const began = process.hrtime.bigint();
  const runner = await run({
    preset: workerPreset(connectionString, events),
    taskList: { noop: async () => {} },
    noHandleSignals: true,
  });
  await done;
  await runner.stop();
  const seconds = Number(process.hrtime.bigint() - began) / 1e9;
  if (failed > 0) throw new Error(`${failed} jobs failed`);
  return jobs / seconds;
}

async function left(connectionString) {
  const utils = await makeWorkerUtils({ connectionString, logger });
  try {
    const { rows } = await utils.withPgClient((client) =>
      client.query("SELECT count(*)::int AS n FROM graphile_worker._private_jobs"),
    );
    return rows[0].n;
  } finally {
    await utils.release();
  }
}

async function main() {
  const [url, jobsArg, bytesArg] = process.argv.slice(2);
  const jobs = Number(jobsArg);
  const bytes = Number(bytesArg ?? 1024);
  if (!url || !Number.isInteger(jobs) || jobs <= 0 || !Number.isInteger(bytes)) {
    throw new Error("usage: node drain.js <database-url> <jobs> <payload-bytes>");
  }
  const enqueuePerS = await enqueue(url, jobs, bytes);
  const drainPerS = await drain(url, jobs);
  const remaining = await left(url);
  if (remaining !== 0) throw new Error(`${remaining} of ${jobs} jobs left after the drain`);
  process.stdout.write(
    `${JSON.stringify({ jobs, enqueue_per_s: enqueuePerS, drain_per_s: drainPerS, version })}\n`,
  );
}

main().catch((e) => {
  process.stderr.write(`drain.js: ${e && e.stack ? e.stack : e}\n`);
  process.exit(1);
});
