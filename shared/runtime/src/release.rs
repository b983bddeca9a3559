//! Which release a binary is: its version and the commit it was built from (`--version`, the
//! dispatcher's `build_info` metric and heartbeat). The releases and what upgrading needs:
//! CHANGELOG.md, docs/releases.md.

/// The release's version (the workspace's).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The commit built (build.rs: `OUTBOX_COMMIT`, else git, else `unknown`).
pub const COMMIT: &str = env!("OUTBOX_COMMIT");

/// What `--version` prints after the binary's name: `0.2.0 (commit 0123456789ab)`.
pub const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("OUTBOX_COMMIT"),
    ")"
);
