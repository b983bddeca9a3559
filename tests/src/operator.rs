//! The operator's commands as on-call runs them: the real `dispatcher` binary against a test
//! database, as `alice`, with a short connect timeout.

use serde_json::Value;

use crate::db::TestDb;
use crate::process::Spawn;

/// Runs `dispatcher ARGS` against `db`; returns (exit code, stdout, stderr).
pub fn dispatcher(db: &TestDb, args: &[&str]) -> (i32, String, String) {
    let out = Spawn::binary("dispatcher")
        .args(args)
        .env("DATABASE_URL", db.url())
        .env("OUTBOX_ACTOR", "alice")
        .env("OUTBOX_DB_CONNECT_TIMEOUT", "5s")
        .env_remove("PUBSUB_PROJECT_ID")
        .output_blocking()
        .expect("run the dispatcher binary");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `dispatcher ARGS` (which must succeed) and parses what it prints as JSON.
pub fn json(db: &TestDb, args: &[&str]) -> Value {
    let (code, out, err) = dispatcher(db, args);
    assert_eq!(code, 0, "{args:?} succeeds: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?} prints JSON ({e}): {out}"))
}
