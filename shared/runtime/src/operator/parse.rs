//! The one parser for the operators' instants and durations, and the near matches a refusal of an
//! unknown name lists.

use chrono::{DateTime, Utc};

use super::OpsError;

/// An instant: RFC 3339 (`2026-11-30T12:00:00Z`) or a duration ago (`2h`, `90m`, `30d`) from `now`.
pub fn parse_instant(flag: &str, s: &str, now: DateTime<Utc>) -> Result<DateTime<Utc>, OpsError> {
    let s = s.trim();
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Ok(t.with_timezone(&Utc));
    }
    humantime::parse_duration(s)
        .ok()
        .and_then(|d| chrono::Duration::from_std(d).ok())
        .and_then(|d| now.checked_sub_signed(d))
        .ok_or_else(|| {
            OpsError::Usage(format!(
                "{flag} {s:?} is neither an RFC 3339 time (2026-11-30T12:00:00Z) nor a duration \
                 ago (2h, 30m)"
            ))
        })
}

/// A duration (`30s`, `12h`, `30d`).
pub fn parse_age(flag: &str, s: &str) -> Result<std::time::Duration, OpsError> {
    humantime::parse_duration(s.trim()).map_err(|_| {
        OpsError::Usage(format!(
            "{flag} {s:?} is not a duration (e.g. 30s, 12h, 30d)"
        ))
    })
}

/// The names in `known` close to `given`, closest first (at most five): the same ignoring case
/// and surrounding space, or within a few edits (a typo, a missing letter, `topic` for `topics`).
pub fn near<'a>(given: &str, known: impl IntoIterator<Item = &'a str>) -> Vec<&'a str> {
    let g = given.trim().to_lowercase();
    let limit = (g.chars().count() / 4).clamp(2, 4);
    let mut close: Vec<(usize, &str)> = known
        .into_iter()
        .filter_map(|k| {
            let d = edits(&g, &k.to_lowercase());
            (d <= limit).then_some((d, k))
        })
        .collect();
    close.sort();
    close.dedup();
    close.into_iter().take(5).map(|(_, k)| k).collect()
}

/// The Levenshtein distance of `a` and `b` (characters).
fn edits(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (above + 1)
                .min(row[j] + 1)
                .min(diagonal + usize::from(ca != *cb));
            diagonal = above;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now() -> DateTime<Utc> {
        DateTime::from_timestamp(1_796_040_000, 0).unwrap_or_default()
    }

    #[test]
    fn instants_are_rfc3339_or_a_duration_ago() {
        let micros = |s: &str| parse_instant("--to", s, now()).map(|t| t.timestamp_micros());
        assert_eq!(
            micros("2026-11-30T12:00:00.000001Z").ok(),
            Some(1_796_040_000_000_001)
        );
        assert_eq!(
            micros("2026-11-30T13:00:00+01:00").ok(),
            Some(1_796_040_000_000_000)
        );
        assert_eq!(
            micros(" 2h ").ok(),
            Some(1_796_040_000_000_000 - 7_200_000_000)
        );
        let e = parse_instant("--to", "yesterday-ish", now()).expect_err("refused");
        assert_eq!(e.exit(), super::super::Exit::Usage);
        assert!(e.to_string().contains("--to \"yesterday-ish\""), "{e}");
    }

    #[test]
    fn ages_are_durations() {
        assert_eq!(
            parse_age("--older-than", "30d").ok(),
            Some(std::time::Duration::from_secs(30 * 86_400))
        );
        let e = parse_age("--older-than", "a month").expect_err("refused");
        assert!(e.to_string().contains("--older-than \"a month\""), "{e}");
    }

    #[test]
    fn near_matches_catch_typos_case_and_space_but_not_strangers() {
        let known = [
            "projects/ops-project/topics/shipments",
            "projects/ops-project/topics/invoices",
        ];
        assert_eq!(
            near("projects/ops-project/topic/shipments", known),
            vec![known[0]]
        );
        assert_eq!(
            near("projects/ops-project/topics/Shipments ", known),
            vec![known[0]]
        );
        assert!(near("projects/other/topics/audit-log", known).is_empty());
        assert_eq!(near("ordrs", ["orders", "payments"]), vec!["orders"]);
        assert_eq!(near("order", ["orders", "payments"]), vec!["orders"]);
    }
}
