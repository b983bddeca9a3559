//! What the operator commands of both binaries share: who is acting. Exit codes and printing an
//! error once are the binaries' one rule ([`crate::exit`], re-exported here).

pub use crate::exit::{Exit, describe};

/// Who says they perform an operator action: `--actor`, else `OUTBOX_ACTOR`, else the OS user
/// (`USER`, `LOGNAME`). `None` when none is set (a container usually has neither): the audit row
/// then names the database login, which it records in any case (`db_user`, set by the database,
/// so it cannot be forged: the declared actor is a claim, the login a fact).
pub fn actor(flag: Option<&str>) -> Option<String> {
    let given = |v: Option<String>| v.filter(|a| !a.trim().is_empty());
    given(flag.map(str::to_owned))
        .or_else(|| given(std::env::var("OUTBOX_ACTOR").ok()))
        .or_else(|| given(std::env::var("USER").ok()))
        .or_else(|| given(std::env::var("LOGNAME").ok()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_actor_comes_from_the_flag_first() {
        assert_eq!(actor(Some("alice")).as_deref(), Some("alice"));
        assert_ne!(actor(Some("  ")).as_deref(), Some("  "));
    }
}
