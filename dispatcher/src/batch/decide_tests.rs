//! Table tests of the batch decisions: every case of the unit of work without PostgreSQL.

use std::collections::HashSet;
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use outbox_shared::ClaimedMessage;
use outbox_shared::retry::RetrySchedule;
use outbox_shared::store::dead_letter::ErrorKind;

use super::*;
use crate::pubsub::classify::PublishFailure;

const T: &str = "projects/p/topics/t";
const SKIP: &str = "projects/p/topics/skip";

fn now() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 12, 1, 12, 0, 0)
        .single()
        .expect("a valid instant")
}

fn msg(id: i64, topic: &str, key: Option<&str>, attempts: i32) -> ClaimedMessage {
    crate::test_support::message(id, topic, key, attempts)
}

fn schedule() -> RetrySchedule {
    RetrySchedule {
        base: Duration::from_secs(2),
        cap: Duration::from_secs(60),
        jitter: 0.0,
        max_attempts: 3,
    }
}

/// Topics slowed down by quota wait 4 s before jitter (`T`), 8 s (`SKIP`).
fn quota_backoff(topic: &str) -> Duration {
    Duration::from_secs(if topic == T { 4 } else { 8 })
}

fn policy(schedule: &RetrySchedule) -> Policy<'_> {
    static SKIPS: std::sync::LazyLock<Vec<String>> =
        std::sync::LazyLock::new(|| vec![SKIP.to_owned()]);
    Policy {
        schedule,
        skip_dead_letter_topics: &SKIPS,
        quota_backoff: &quota_backoff,
    }
}

fn ok(id: &str) -> Attempt {
    Attempt::Published(id.to_owned())
}
fn permanent() -> Attempt {
    Attempt::Failed(PublishFailure::permanent("INVALID_ARGUMENT: bad"))
}
fn transient() -> Attempt {
    Attempt::Failed(PublishFailure::transient("UNAVAILABLE: down"))
}
fn refused(code: &str) -> Attempt {
    Attempt::Failed(PublishFailure {
        kind: FailureKind::TopicRefused,
        message: format!("{code}: the topic"),
    })
}
fn throttled() -> Attempt {
    Attempt::Failed(PublishFailure {
        kind: FailureKind::Throttled,
        message: "RESOURCE_EXHAUSTED: quota".into(),
    })
}
fn paused() -> Attempt {
    Attempt::Failed(PublishFailure {
        kind: FailureKind::NotAttempted,
        message: "ordering key paused".into(),
    })
}

/// (published ids, retried ids, dead-lettered ids with kinds, released ids).
type Outcome = (Vec<i64>, Vec<i64>, Vec<(i64, ErrorKind)>, Vec<i64>);

fn outcome(d: &Decision) -> Outcome {
    let s = &d.settlement;
    (
        s.published.iter().map(|(id, _)| *id).collect(),
        s.retries.iter().map(|r| r.id).collect(),
        s.dead_letters.iter().map(|f| (f.id, f.kind)).collect(),
        s.released.clone(),
    )
}

#[test]
fn a_locally_rejected_keyed_message_holds_back_the_rest_of_its_key_unless_its_topic_skips() {
    let s = schedule();
    let claimed = vec![
        msg(1, T, Some("k"), 0),
        msg(2, T, Some("k"), 0),
        msg(3, T, Some("k"), 0),
        msg(4, T, Some("other"), 0),
        msg(5, SKIP, Some("k"), 0),
        msg(6, SKIP, Some("k"), 0),
        msg(7, T, None, 0),
        msg(8, T, None, 0),
    ];
    let rejected: HashSet<usize> = [1, 4, 6].into_iter().collect();
    let held = hold_back(&claimed, &rejected, policy(&s));
    assert_eq!(
        held,
        vec![false, true, true, false, true, false, true, false],
        "ok-1 goes, bad-2 and ok-3 wait; the other key goes; on the skip topic ok-6 goes; an \
         unkeyed rejection holds back nothing else"
    );
    let attempts = vec![
        ok("m1"),
        Attempt::Rejected("attribute too long".into()),
        Attempt::HeldBack,
        ok("m4"),
        Attempt::Rejected("attribute too long".into()),
        ok("m6"),
        Attempt::Rejected("too large".into()),
        ok("m8"),
    ];
    let d = decide(&claimed, attempts, policy(&s), now(), || 0.5);
    assert_eq!(
        outcome(&d),
        (
            vec![1, 4, 6, 8],
            vec![],
            vec![
                (2, ErrorKind::Permanent),
                (5, ErrorKind::Permanent),
                (7, ErrorKind::Permanent)
            ],
            vec![3],
        )
    );
    assert!(
        d.settlement.dead_letters[0]
            .error
            .starts_with("rejected before publishing: attribute too long"),
        "{:?}",
        d.settlement.dead_letters
    );
}

#[test]
fn a_permanent_failure_on_a_key_dead_letters_it_and_releases_the_rest_of_the_key() {
    let s = schedule();
    let claimed = vec![
        msg(1, T, Some("k"), 0),
        msg(2, T, Some("k"), 0),
        msg(3, T, Some("k"), 0),
        msg(4, SKIP, Some("k"), 0),
        msg(5, SKIP, Some("k"), 0),
    ];
    let attempts = vec![ok("m1"), permanent(), ok("late"), permanent(), ok("m5")];
    let d = decide(&claimed, attempts, policy(&s), now(), || 0.5);
    assert_eq!(
        outcome(&d),
        (
            vec![1, 3, 5],
            vec![],
            vec![(2, ErrorKind::Permanent), (4, ErrorKind::Permanent)],
            vec![],
        ),
        "a publish the client already made is recorded; on the skip topic the key goes on"
    );
    let claimed = vec![
        msg(1, T, Some("k"), 0),
        msg(2, T, Some("k"), 0),
        msg(3, T, Some("k"), 0),
    ];
    let attempts = vec![permanent(), paused(), paused()];
    let d = decide(&claimed, attempts, policy(&s), now(), || 0.5);
    assert_eq!(
        outcome(&d),
        (vec![], vec![], vec![(1, ErrorKind::Permanent)], vec![2, 3])
    );
}

#[test]
fn transient_failures_follow_the_schedule_and_exhausted_ones_are_dead_lettered() {
    let s = schedule();
    let claimed = vec![
        msg(1, T, None, 0),
        msg(2, T, None, 2),
        msg(3, T, Some("k"), 1),
        msg(4, T, Some("k"), 0),
    ];
    let attempts = vec![transient(), transient(), transient(), paused()];
    let d = decide(&claimed, attempts, policy(&s), now(), || 0.5);
    assert_eq!(
        outcome(&d),
        (vec![], vec![1, 3], vec![(2, ErrorKind::Exhausted)], vec![4])
    );
    let r = &d.settlement.retries;
    assert_eq!(
        (r[0].attempts, r[0].next_attempt_at),
        (1, now() + chrono::Duration::seconds(2))
    );
    assert_eq!(
        (r[1].attempts, r[1].next_attempt_at),
        (2, now() + chrono::Duration::seconds(4))
    );
    assert_eq!(r[0].last_error, "UNAVAILABLE: down");
    assert_eq!(d.settlement.dead_letters[0].attempts, 3);
}

#[test]
fn an_outage_is_suspected_only_when_everything_sent_failed_transiently() {
    assert!(may_be_outage(&[
        transient(),
        paused(),
        Attempt::Rejected("x".into())
    ]));
    assert!(
        !may_be_outage(&[transient(), ok("m")]),
        "something got through"
    );
    assert!(
        !may_be_outage(&[transient(), permanent()]),
        "the broker answered"
    );
    assert!(
        !may_be_outage(&[Attempt::Rejected("x".into()), Attempt::HeldBack]),
        "nothing sent"
    );
    assert!(
        !may_be_outage(&[paused()]),
        "not attempted is not a failure of the broker"
    );
    assert!(
        !may_be_outage(&[transient(), refused("NOT_FOUND")]),
        "a topic refused is an answer"
    );
    assert!(
        !may_be_outage(&[transient(), throttled()]),
        "a quota refusal is an answer"
    );
}

#[test]
fn a_topic_refused_as_a_whole_is_held_its_rows_released_untouched_and_its_keys_in_order() {
    let s = schedule();
    let other = "projects/p/topics/other";
    let claimed = vec![
        msg(1, T, Some("k"), 3),
        msg(2, T, Some("k"), 0),
        msg(3, T, None, 7),
        msg(4, T, None, 0),
        msg(5, other, Some("k"), 0),
        msg(6, other, None, 0),
    ];
    let attempts = vec![
        refused("PERMISSION_DENIED"),
        paused(),
        refused("PERMISSION_DENIED"),
        refused("PERMISSION_DENIED"),
        ok("m5"),
        ok("m6"),
    ];
    assert!(topic_answered(&claimed, &attempts, other));
    assert!(
        !topic_answered(&claimed, &attempts, T),
        "T refused every request"
    );
    let d = decide(&claimed, attempts, policy(&s), now(), || 0.5);
    assert_eq!(
        outcome(&d),
        (vec![5, 6], vec![], vec![], vec![1, 2, 3, 4]),
        "nothing of T is charged, retried or dead-lettered; the other topic is published"
    );
    assert_eq!(
        d.settlement.holds,
        vec![Hold {
            topic: T.to_owned(),
            code: "PERMISSION_DENIED".to_owned(),
            message: "the topic".to_owned(),
        }],
        "T is held once, with the code and what Pub/Sub said"
    );
    // Refused with a message's own fault, a probe shows the topic answers.
    assert!(topic_answered(&claimed[..1], &[permanent()], T));
}

#[test]
fn a_quota_refusal_waits_the_topics_backoff_with_jitter_and_charges_no_attempt() {
    let s = schedule();
    let claimed = vec![
        msg(1, T, None, 5),
        msg(2, T, Some("k"), 2),
        msg(3, T, Some("k"), 0),
        msg(4, SKIP, None, 19),
    ];
    let attempts = vec![throttled(), throttled(), paused(), throttled()];
    let d = decide(&claimed, attempts, policy(&s), now(), || 1.0);
    assert_eq!(
        outcome(&d),
        (vec![], vec![1, 2, 4], vec![], vec![3]),
        "the key waits behind its head, in order"
    );
    assert_eq!(d.throttled, 3);
    let r = &d.settlement.retries;
    assert_eq!(
        r.iter().map(|r| r.attempts).collect::<Vec<_>>(),
        vec![5, 2, 19],
        "no attempt charged, even one short of the maximum (3): nothing is exhausted by quota"
    );
    assert_eq!(r[0].next_attempt_at, now() + chrono::Duration::seconds(4));
    assert_eq!(r[2].next_attempt_at, now() + chrono::Duration::seconds(8));
    assert!(r[0].last_error.starts_with("RESOURCE_EXHAUSTED: quota"));
    assert!(r[0].last_error.contains("without charging an attempt"));
    let d = decide(&claimed[..1], vec![throttled()], policy(&s), now(), || 0.0);
    assert_eq!(
        d.settlement.retries[0].next_attempt_at,
        now() + chrono::Duration::seconds(2),
        "jitter takes at most half the backoff"
    );
}

#[test]
fn an_outage_releases_everything_but_the_local_rejections_and_charges_nothing() {
    let claimed = vec![
        msg(1, T, Some("k"), 4),
        msg(2, T, None, 0),
        msg(3, T, None, 0),
    ];
    let attempts = vec![
        transient(),
        Attempt::Rejected("too large".into()),
        transient(),
    ];
    let d = outage(&claimed, attempts);
    assert_eq!(
        outcome(&d),
        (vec![], vec![], vec![(2, ErrorKind::Permanent)], vec![1, 3])
    );
}
