//! `dispatcher console`: the operator's console in a browser. The overview (per topic: due,
//! held, waiting, oldest claimable age, dead letters, paused; the topics Pub/Sub refuses, held;
//! blocked keys; replicas; producer streams; the warnings `status` gives; plots of the last hour
//! from samples it keeps itself), the messages not yet sent (`pending.rs`: filters, paging), the
//! dead letters (filters, paging, a safe preview, the key each one holds back), the audit trail,
//! and, when started with `--actions`, pause/resume, replay/discard of dead letters and
//! cancel/retry-now of pending messages, each previewed (a dry run lists exactly the ids),
//! confirmed with a reason and audited with the identity.
//!
//! One source of truth: every query and action is an operator command of this binary
//! ([`crate::ops`]), parsed from the CLI's own flags and run on the console's pool.
//!
//! Security: loopback only in local mode, where a request must also name a loopback host
//! (`127.0.0.1`, `[::1]` or `localhost`: a page served under another name that resolves to
//! 127.0.0.1, DNS rebinding, is refused before anything renders); behind Identity-Aware Proxy every request needs the
//! proxy's signed assertion ([`auth`]); every change needs the identity's CSRF token and a
//! same-origin request ([`csrf`]); no payload beyond the safe preview; a strict
//! Content-Security-Policy and no external asset or script ([`html`]).
//!
//! Where the code is: `args.rs` the options and their checks; `state.rs` the shared state
//! ([`Console`]) and the `status` it reads in the background for the overview; `extract.rs`
//! who asks ([`Who`]) and a change's checked form ([`Change`]); `router.rs` the routes and the
//! local mode's `Host` check; `server.rs` the process (connect, bind, serve until a signal);
//! `error.rs` why it cannot run; `commands.rs` how a page runs an operator command; the pages:
//! `overview.rs`, `pending.rs`, `dead_letters.rs`, `blocked.rs`, `audit.rs`; `change.rs` every
//! change (preview by the command's dry run, confirm, apply), its actions a type ([`change::Act`]); `auth.rs`, `csrf.rs` and `html.rs` the security above; `fields.rs` what a page
//! reads; `filters.rs` the lists' filters (fields, flags, form); `samples.rs` and `svg.rs` the
//! last hour and its plots.

mod args;
mod audit;
mod auth;
mod blocked;
mod change;
mod commands;
mod csrf;
mod dead_letters;
mod error;
mod extract;
mod fields;
mod filters;
mod html;
mod overview;
mod pending;
mod router;
mod samples;
mod server;
mod state;
mod svg;

pub use args::{AuthMode, ConsoleArgs, is_iap_audience};
pub use auth::{AuthError, Claims, IAP_HEADER, IAP_ISSUER, Keys, parse_keys, verify};
pub use error::ConsoleError;
pub use extract::{Change, Who};
pub use router::{is_loopback_host, router};
pub use server::{run, serve};
pub use state::Console;
