//! Who says they perform an operator action.
//!
//! `--actor`, else `OUTBOX_ACTOR`, else the OS user: `USER` or `LOGNAME` when set, else the name
//! of the process's user id in `/etc/passwd` (`kubectl exec` and Cloud Run set neither variable,
//! but the image's user is in its passwd file), else `uid:<n>`. `None` only where the user id
//! cannot be read (not Linux): the audit row then names the database login, which it records in
//! any case (`db_user`, set by the database, so it cannot be forged: the declared actor is a
//! claim, the login a fact).

/// The declared actor: see the module doc.
pub fn actor(flag: Option<&str>) -> Option<String> {
    declared(flag, |name| std::env::var(name).ok()).or_else(os_user)
}

/// The first non-blank of the flag, `OUTBOX_ACTOR`, `USER` and `LOGNAME` (read with `env`).
fn declared(flag: Option<&str>, env: impl Fn(&str) -> Option<String>) -> Option<String> {
    let given = |v: Option<String>| {
        v.map(|a| a.trim().to_owned())
            .filter(|a: &String| !a.is_empty())
    };
    given(flag.map(str::to_owned))
        .or_else(|| given(env("OUTBOX_ACTOR")))
        .or_else(|| given(env("USER")))
        .or_else(|| given(env("LOGNAME")))
}

/// The process's user by its id: its name in `/etc/passwd`, else `uid:<n>`.
fn os_user() -> Option<String> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let uid = effective_uid(&status)?;
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
    Some(user_name(&passwd, uid).unwrap_or_else(|| format!("uid:{uid}")))
}

/// The effective user id from `/proc/self/status` (`Uid: real effective saved fs`).
fn effective_uid(status: &str) -> Option<u32> {
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(2)?.parse().ok()
}

/// The name of `uid` in a passwd file (`name:x:uid:gid:…`).
fn user_name(passwd: &str, uid: u32) -> Option<String> {
    passwd.lines().find_map(|line| {
        let mut fields = line.split(':');
        let name = fields.next()?;
        let id: u32 = fields.nth(1)?.parse().ok()?;
        (id == uid && !name.is_empty()).then(|| name.to_owned())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flag_comes_first_then_outbox_actor_then_user_then_logname() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                vars.iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| (*v).to_owned())
            }
        };
        let all = env(&[("OUTBOX_ACTOR", "ops"), ("USER", "u"), ("LOGNAME", "l")]);
        assert_eq!(declared(Some(" alice "), all).as_deref(), Some("alice"));
        assert_eq!(declared(Some("  "), all).as_deref(), Some("ops"));
        assert_eq!(
            declared(None, env(&[("USER", ""), ("LOGNAME", "l")])).as_deref(),
            Some("l")
        );
        assert_eq!(declared(None, env(&[])), None);
    }

    #[test]
    fn without_variables_the_user_id_names_the_user() {
        let status = "Name:\tdispatcher\nUid:\t1000\t65532\t65532\t65532\nGid:\t0\n";
        assert_eq!(effective_uid(status), Some(65532));
        let passwd =
            "root:x:0:0:root:/root:/bin/sh\nnonroot:x:65532:65532::/home/nonroot:/sbin/nologin\n";
        assert_eq!(user_name(passwd, 65532).as_deref(), Some("nonroot"));
        assert_eq!(user_name(passwd, 7), None);
        assert!(actor(None).is_some(), "on Linux some name is always found");
    }
}
