//! `dispatcher console`, the real binary: behind Identity-Aware Proxy a request without a valid
//! assertion is refused (missing, expired, for another audience, signed by another key); a change
//! without the identity's CSRF token, or from another site, is refused and changes nothing; a
//! previewed, confirmed replay moves the dead letter and audits the identity; a read-only console
//! offers and accepts no change; what the database holds cannot become markup; a local console
//! answers to loopback host names only (DNS rebinding); a pause of a topic the database has not
//! seen is refused at its preview and goes through as a new topic; thousands of blocked keys are
//! summed up per topic and paged; a placeholder IAP audience stops the console at start; a cancel
//! of a whole filter of 901 messages previews, confirms and cancels all 901 (issue #51).

use std::time::Duration;

use harness::db::TestDb;
use harness::fixtures::{count, dead_letter, enqueue, message};
use harness::iap::IapStandIn;
use harness::process::{Process, Spawn, http_request};

const AUDIENCE: &str = "/projects/123456/global/backendServices/7890";
const TOPIC: &str = "projects/test-project/topics/console";

/// The console binary on `db` with `args`, on a free port; returns it and its address.
async fn console(db: &TestDb, args: &[&str]) -> (Process, String) {
    let mut p = Spawn::binary("dispatcher")
        .arg("console")
        .args(["--listen-addr", "127.0.0.1:0"])
        .args(args)
        .env("DATABASE_URL", db.url())
        .start()
        .expect("start the console");
    let addr = p
        .bound_addr(Duration::from_secs(30))
        .await
        .expect("the console's address")
        .to_string();
    (p, addr)
}

/// The CSRF token of the first form of `page`.
fn csrf_of(page: &str) -> String {
    let at = page
        .find("name=\"csrf\" value=\"")
        .expect("a form with a CSRF token")
        + "name=\"csrf\" value=\"".len();
    page[at..].split('"').next().unwrap_or_default().to_owned()
}

#[tokio::test]
async fn behind_iap_a_request_without_a_valid_assertion_is_refused() {
    let db = TestDb::new().await;
    let iap = IapStandIn::start().await;
    let keys = iap.keys_url();
    let (_console, addr) = console(
        &db,
        &[
            "--auth",
            "iap",
            "--iap-audience",
            AUDIENCE,
            "--iap-keys-url",
            &keys,
            "--actions",
        ],
    )
    .await;
    let get = |assertion: Option<String>| {
        let addr = addr.clone();
        async move {
            let headers: Vec<(&str, &str)> = match &assertion {
                Some(a) => vec![("x-goog-iap-jwt-assertion", a.as_str())],
                None => vec![],
            };
            http_request(&addr, "GET", "/", &headers, "").await
        }
    };
    let refused = [
        ("no assertion", None),
        (
            "expired",
            Some(iap.assertion("oncall@example.com", AUDIENCE, -300)),
        ),
        (
            "another audience",
            Some(iap.assertion(
                "oncall@example.com",
                "/projects/1/global/backendServices/2",
                600,
            )),
        ),
        (
            "another key",
            Some(IapStandIn::forged("oncall@example.com", AUDIENCE)),
        ),
        ("not a JWT", Some("garbage".to_owned())),
    ];
    for (case, assertion) in refused {
        let r = get(assertion).await;
        assert_eq!(r.status, 401, "{case}: refused; {}", r.body);
        assert!(
            !r.body.contains("<table"),
            "{case}: nothing of the outbox shown"
        );
    }
    let r = get(Some(iap.assertion("oncall@example.com", AUDIENCE, 600))).await;
    assert_eq!(r.status, 200, "a valid assertion: {}", r.body);
    assert!(
        r.body
            .contains("<span class=\"who\" id=\"identity\">oncall@example.com</span>"),
        "the identity is the assertion's email"
    );
    let csp = r.header("content-security-policy").unwrap_or_default();
    assert!(
        csp.contains("default-src 'none'") && csp.contains("frame-ancestors 'none'"),
        "{csp}"
    );
    assert!(!r.body.contains("<script"), "no script on the page");
    let health = http_request(&addr, "GET", "/healthz", &[], "").await;
    assert_eq!(
        health.status, 200,
        "the load balancer's health check needs no identity"
    );
    let assertion = iap.assertion("oncall@example.com", AUDIENCE, 600);
    let public = http_request(
        &addr,
        "GET",
        "/",
        &[
            ("Host", "outbox.example.com"),
            ("x-goog-iap-jwt-assertion", &assertion),
        ],
        "",
    )
    .await;
    assert_eq!(
        public.status, 200,
        "behind IAP the public host name is served (the assertion decides): {}",
        public.body
    );
}

#[tokio::test]
async fn a_change_needs_the_identitys_csrf_token_and_a_same_origin_request() {
    let db = TestDb::new().await;
    let id = dead_letter(
        &db.pool,
        TOPIC,
        Some("k1"),
        b"{\"n\":1}",
        "INVALID_ARGUMENT: schema",
    )
    .await;
    let (_console, addr) = console(&db, &["--actions", "--local-user", "alice@example.com"]).await;
    let detail = http_request(&addr, "GET", &format!("/dead-letters/{id}"), &[], "").await;
    assert_eq!(detail.status, 200, "{}", detail.body);
    let token = csrf_of(&detail.body);
    let form =
        |csrf: &str| format!("action=replay&scope=ids&id={id}&reason=schema+fixed&csrf={csrf}");

    for (case, body, headers) in [
        (
            "no token",
            format!("action=replay&scope=ids&id={id}&reason=x"),
            vec![],
        ),
        ("a wrong token", form("AAAA"), vec![]),
        (
            "another site",
            form(&token),
            vec![("Sec-Fetch-Site", "cross-site")],
        ),
        (
            "another origin",
            form(&token),
            vec![("Origin", "https://evil.example")],
        ),
    ] {
        for path in ["/actions/preview", "/actions/apply"] {
            let r = http_request(&addr, "POST", path, &headers, &body).await;
            assert_eq!(r.status, 403, "{case} {path}: refused; {}", r.body);
            let says_site = r.body.contains("came from another site");
            assert_eq!(
                says_site,
                case.starts_with("another"),
                "{case} {path}: the refusal says why (the site, or the token): {}",
                r.body
            );
        }
    }
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pubsub_outbox_dead_letter").await,
        1,
        "nothing changed"
    );

    let preview = http_request(&addr, "POST", "/actions/preview", &[], &form(&token)).await;
    assert_eq!(preview.status, 200, "{}", preview.body);
    assert!(
        preview
            .body
            .contains(&format!("<span id=\"ids\">{id}</span>")),
        "the preview lists exactly the id: {}",
        preview.body
    );
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pubsub_outbox_dead_letter").await,
        1,
        "a preview changes nothing"
    );
    let done = http_request(
        &addr,
        "POST",
        "/actions/apply",
        &[],
        &form(&csrf_of(&preview.body)),
    )
    .await;
    assert_eq!(done.status, 200, "{}", done.body);
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pubsub_outbox_dead_letter").await,
        0,
        "replayed"
    );
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM pubsub_outbox WHERE ordering_key = 'k1'"
        )
        .await,
        1,
        "back in the outbox"
    );
    let (actor, reason): (String, String) =
        sqlx::query_as("SELECT actor, reason FROM pubsub_outbox_audit WHERE action = 'replay'")
            .fetch_one(&db.pool)
            .await
            .expect("one audit row");
    assert_eq!(
        (actor.as_str(), reason.as_str()),
        ("alice@example.com", "schema fixed")
    );
}

#[tokio::test]
async fn a_read_only_console_offers_and_accepts_no_change() {
    let db = TestDb::new().await;
    let id = dead_letter(&db.pool, TOPIC, None, b"{}", "INVALID_ARGUMENT: schema").await;
    let (_console, addr) = console(&db, &[]).await;
    let detail = http_request(&addr, "GET", &format!("/dead-letters/{id}"), &[], "").await;
    assert_eq!(detail.status, 200);
    assert!(!detail.body.contains("<form id=\"act\""), "no action form");
    let r = http_request(
        &addr,
        "POST",
        "/actions/apply",
        &[],
        &format!("action=discard&scope=ids&id={id}&reason=x&csrf=x"),
    )
    .await;
    assert_eq!(r.status, 403, "{}", r.body);
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pubsub_outbox_dead_letter").await,
        1
    );
}

#[tokio::test]
async fn what_the_database_holds_cannot_become_markup() {
    let db = TestDb::new().await;
    let id = dead_letter(
        &db.pool,
        TOPIC,
        Some("<b>key</b>"),
        b"<script>alert(1)</script>",
        "<img src=x onerror=alert(1)>",
    )
    .await;
    let (_console, addr) = console(&db, &["--actions"]).await;
    for path in [
        format!("/dead-letters/{id}"),
        "/dead-letters".to_owned(),
        "/".to_owned(),
    ] {
        let r = http_request(&addr, "GET", &path, &[], "").await;
        assert_eq!(r.status, 200, "{path}: {}", r.body);
        for raw in ["<script>", "<b>key</b>", "<img src=x"] {
            assert!(
                !r.body.contains(raw),
                "{path} shows {raw} as markup: {}",
                r.body
            );
        }
    }
    let detail = http_request(&addr, "GET", &format!("/dead-letters/{id}"), &[], "").await;
    assert!(
        detail
            .body
            .contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
        "the preview, escaped"
    );
    let unknown = http_request(&addr, "GET", "/dead-letters/999999", &[], "").await;
    assert_eq!(unknown.status, 404);
}

#[tokio::test]
async fn a_local_console_answers_to_loopback_host_names_only() {
    let db = TestDb::new().await;
    let _dl = dead_letter(&db.pool, TOPIC, Some("k"), b"{}", "INVALID_ARGUMENT: x").await;
    let (_console, addr) = console(&db, &["--actions", "--local-user", "alice"]).await;
    let port = addr
        .rsplit_once(':')
        .map(|(_, p)| p.to_owned())
        .unwrap_or_default();
    for host in [
        format!("127.0.0.1:{port}"),
        format!("localhost:{port}"),
        format!("[::1]:{port}"),
    ] {
        let r = http_request(&addr, "GET", "/", &[("Host", &host)], "").await;
        assert_eq!(r.status, 200, "{host}: served; {}", r.body);
    }
    // A page an attacker serves as evil.example:PORT, a name pointed at 127.0.0.1.
    let evil = format!("evil.example:{port}");
    let page = http_request(&addr, "GET", "/", &[("Host", &evil)], "").await;
    assert_eq!(
        page.status, 421,
        "refused before anything renders: {}",
        page.body
    );
    assert!(
        !page.body.contains("csrf") && !page.body.contains("<table"),
        "no token, nothing of the outbox: {}",
        page.body
    );
    // Even with a real token (read through the loopback name), a pause it posts is refused.
    let token = csrf_of(&http_request(&addr, "GET", "/", &[], "").await.body);
    let origin = format!("http://{evil}");
    for path in ["/actions/preview", "/actions/apply"] {
        let r = http_request(
            &addr,
            "POST",
            path,
            &[("Host", &evil), ("Origin", &origin)],
            &format!("action=pause&topic={TOPIC}&reason=x&csrf={token}"),
        )
        .await;
        assert_eq!(r.status, 421, "{path}: refused; {}", r.body);
    }
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pubsub_outbox_paused_topic").await,
        0,
        "nothing paused"
    );
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pubsub_outbox_audit").await,
        0,
        "nothing audited"
    );
    // Every answer carries the security headers, axum's own 404 and 400 too.
    for (path, status) in [("/no-such-page", 404), ("/dead-letters/not-a-number", 400)] {
        let r = http_request(&addr, "GET", path, &[], "").await;
        assert_eq!(r.status, status, "{path}: {}", r.body);
        for name in [
            "content-security-policy",
            "x-frame-options",
            "x-content-type-options",
            "referrer-policy",
            "cache-control",
        ] {
            assert!(
                r.headers.iter().any(|(k, _)| k == name),
                "{path}: {name} in {:?}",
                r.headers
            );
        }
    }
}

#[tokio::test]
async fn a_pause_of_a_topic_the_database_has_not_seen_is_refused_at_its_preview_unless_new() {
    let db = TestDb::new().await;
    let (_console, addr) = console(&db, &["--actions", "--local-user", "alice"]).await;
    let token = csrf_of(&http_request(&addr, "GET", "/", &[], "").await.body);
    let fresh = "projects/test-project/topics/not-yet-seen";
    let form = |extra: &str| format!("action=pause&topic={fresh}&reason=&csrf={token}{extra}");
    let refused = http_request(&addr, "POST", "/actions/preview", &[], &form("")).await;
    assert_eq!(refused.status, 400, "{}", refused.body);
    assert!(
        refused.body.contains("is not known here"),
        "the preview says why, as the command would: {}",
        refused.body
    );
    let preview = http_request(
        &addr,
        "POST",
        "/actions/preview",
        &[],
        &form("&new_topic=yes"),
    )
    .await;
    assert_eq!(preview.status, 200, "{}", preview.body);
    assert!(
        preview.body.contains("name=\"new_topic\" value=\"yes\"")
            && preview.body.contains("--new-topic"),
        "the confirmation carries it, and the command line shows it: {}",
        preview.body
    );
    let apply = http_request(
        &addr,
        "POST",
        "/actions/apply",
        &[],
        &format!(
            "action=pause&topic={fresh}&new_topic=yes&reason=before+its+first+message&csrf={token}"
        ),
    )
    .await;
    assert_eq!(apply.status, 200, "{}", apply.body);
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pubsub_outbox_paused_topic").await,
        1,
        "paused"
    );
}

#[tokio::test]
async fn thousands_of_blocked_keys_are_summed_up_per_topic_and_paged() {
    let db = TestDb::new().await;
    // What a keyed topic whose Pub/Sub topic vanished leaves: a dead letter per key.
    sqlx::query(
        "INSERT INTO pubsub_outbox_dead_letter (topic, ordering_key, dedupe_key, payload, created_at,
                                                attempts, error_kind, last_error, source)
         SELECT $1, 'key-' || lpad(n::text, 5, '0'), 'dl-' || n, '\\x7b7d', now(), 1, 'permanent',
                'NOT_FOUND: topic', 'dispatcher'
         FROM generate_series(1, 2000) n",
    )
    .bind(TOPIC)
    .execute(&db.pool)
    .await
    .expect("2,000 blocked keys");
    let (_console, addr) = console(&db, &[]).await;
    let overview = http_request(&addr, "GET", "/", &[], "").await;
    assert_eq!(overview.status, 200);
    assert_eq!(
        overview.body.matches("are blocked by dead letters").count(),
        1,
        "one warning for the topic: {}",
        overview.body
    );
    assert!(
        overview
            .body
            .contains("2000 ordering keys of projects/test-project/topics/console"),
        "with the count"
    );
    assert!(
        overview.body.len() < 40_000,
        "the overview stays small: {} bytes",
        overview.body.len()
    );
    assert!(
        overview
            .body
            .contains("href=\"/blocked-keys?topic=projects%2Ftest-project%2Ftopics%2Fconsole\""),
        "a link to all of them"
    );
    let first = http_request(
        &addr,
        "GET",
        &format!("/blocked-keys?topic={TOPIC}"),
        &[],
        "",
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(
        first.body.matches("class=\"dead-letter\"").count(),
        100,
        "a page of 100"
    );
    assert!(
        first.body.contains("<code>key-00001</code>")
            && first.body.contains("<code>key-00100</code>")
    );
    assert!(
        first.body.contains("after=key-00100"),
        "the next page starts after the last key"
    );
    let second = http_request(
        &addr,
        "GET",
        &format!("/blocked-keys?topic={TOPIC}&after=key-00100"),
        &[],
        "",
    )
    .await;
    assert!(
        second.body.contains("<code>key-00101</code>")
            && !second.body.contains("<code>key-00100</code>"),
        "{}",
        second.body
    );
}

#[tokio::test]
async fn a_placeholder_iap_audience_stops_the_console_at_start_with_the_fix() {
    let db = TestDb::new().await;
    for audience in [
        "/projects/PROJECT_NUMBER/global/backendServices/SERVICE_ID",
        "",
    ] {
        let out = harness::process::output(
            "dispatcher",
            &[
                "console",
                "--auth",
                "iap",
                "--iap-audience",
                audience,
                "--listen-addr",
                "127.0.0.1:0",
            ],
            &[("DATABASE_URL", db.url().to_owned())],
        )
        .await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{audience:?}: {stderr}");
        assert!(
            stderr.contains("both numbers") && stderr.contains("backend-services describe"),
            "{audience:?}: says what the value is and how to find it: {stderr}"
        );
    }
}

#[tokio::test]
async fn pending_messages_are_cancelled_and_retried_after_a_preview_and_a_held_topic_is_shown() {
    let db = TestDb::new().await;
    harness::fixtures::enqueue(
        &db.pool,
        &[
            outbox_shared::NewMessage::new(TOPIC, "c-1", b"1".to_vec()).with_ordering_key("k"),
            outbox_shared::NewMessage::new(TOPIC, "c-2", b"2".to_vec()).with_ordering_key("k"),
            outbox_shared::NewMessage::new(TOPIC, "w-1", b"3".to_vec()),
        ],
    )
    .await;
    sqlx::raw_sql(&format!(
        "UPDATE pubsub_outbox SET attempts = 2, next_attempt_at = now() + interval '1 hour'
             WHERE dedupe_key = 'w-1';
         INSERT INTO pubsub_outbox_held_topic (topic, code, message, held_since, last_refused_at,
             next_probe_at, probe_interval_ms)
         VALUES ('{TOPIC}', 'PERMISSION_DENIED', 'User not authorized to perform this action.',
                 now() - interval '3 minutes', now(), now() + interval '15 seconds', 15000)"
    ))
    .execute(&db.pool)
    .await
    .expect("a waiting row and a held topic");
    let id: i64 = count(
        &db.pool,
        "SELECT id FROM pubsub_outbox WHERE dedupe_key = 'c-1'",
    )
    .await;
    let (_console, addr) = console(&db, &["--actions", "--local-user", "alice@example.com"]).await;

    let overview = http_request(&addr, "GET", "/", &[], "").await;
    assert_eq!(overview.status, 200, "{}", overview.body);
    assert!(
        overview.body.contains("Held topics: Pub/Sub refuses them")
            && overview.body.contains("PERMISSION_DENIED")
            && overview
                .body
                .contains("User not authorized to perform this action."),
        "the overview shows the held topic with its code and message: {}",
        overview.body
    );
    let listed = http_request(&addr, "GET", &format!("/pending?topic={TOPIC}"), &[], "").await;
    assert_eq!(listed.status, 200, "{}", listed.body);
    assert!(
        listed.body.contains("c-1") && listed.body.contains("w-1"),
        "{}",
        listed.body
    );

    // Cancel the ticked key head: previewed by its dry run (exactly the id, what the key does
    // then), confirmed, audited as the identity; the key is not blocked by it.
    let token = csrf_of(&listed.body);
    let form =
        |csrf: &str| format!("action=cancel&scope=ids&id={id}&reason=sent+twice&csrf={csrf}");
    let preview = http_request(&addr, "POST", "/actions/preview", &[], &form(&token)).await;
    assert_eq!(preview.status, 200, "{}", preview.body);
    assert!(
        preview
            .body
            .contains(&format!("<span id=\"ids\">{id}</span>")),
        "the preview lists exactly the id: {}",
        preview.body
    );
    assert!(preview.body.contains("go on at once"), "{}", preview.body);
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pubsub_outbox").await,
        3
    );
    let done = http_request(
        &addr,
        "POST",
        "/actions/apply",
        &[],
        &form(&csrf_of(&preview.body)),
    )
    .await;
    assert_eq!(done.status, 200, "{}", done.body);
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM pubsub_outbox_dead_letter WHERE error_kind = 'cancelled' AND dedupe_key = 'c-1'"
        )
        .await,
        1
    );

    // Retry now by the whole filter (waiting rows of the topic).
    let waiting = http_request(
        &addr,
        "GET",
        &format!("/pending?topic={TOPIC}&waiting=yes"),
        &[],
        "",
    )
    .await;
    let filter = |csrf: &str| {
        format!("action=retry-now&scope=filter&topic={TOPIC}&waiting=yes&reason=fixed&csrf={csrf}")
    };
    let preview = http_request(
        &addr,
        "POST",
        "/actions/preview",
        &[],
        &filter(&csrf_of(&waiting.body)),
    )
    .await;
    assert_eq!(preview.status, 200, "{}", preview.body);
    let w1: i64 = count(
        &db.pool,
        "SELECT id FROM pubsub_outbox WHERE dedupe_key = 'w-1'",
    )
    .await;
    assert!(
        preview
            .body
            .contains(&format!("<span id=\"ids\">{w1}</span>")),
        "only the waiting row: {}",
        preview.body
    );
    // The confirmation carries the previewed ids.
    let confirm = format!(
        "action=retry-now&scope=ids&id={w1}&reason=fixed&csrf={}",
        csrf_of(&preview.body)
    );
    let done = http_request(&addr, "POST", "/actions/apply", &[], &confirm).await;
    assert_eq!(done.status, 200, "{}", done.body);
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM pubsub_outbox WHERE dedupe_key = 'w-1' AND next_attempt_at <= now() AND attempts = 2"
        )
        .await,
        1,
        "due now, attempts unchanged"
    );
    let actors: Vec<(String, String)> =
        sqlx::query_as("SELECT action, actor FROM pubsub_outbox_audit ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .expect("the audit rows");
    assert_eq!(
        actors,
        vec![
            ("cancel".to_owned(), "alice@example.com".to_owned()),
            ("retry-now".to_owned(), "alice@example.com".to_owned())
        ]
    );
}

/// The ids a preview's confirmation form carries.
fn confirmed_ids(page: &str) -> Vec<i64> {
    page.split("<input type=\"hidden\" name=\"id\" value=\"")
        .skip(1)
        .filter_map(|rest| rest.split('"').next()?.parse().ok())
        .collect()
}

#[tokio::test]
async fn a_whole_filter_cancel_of_901_messages_cancels_901_with_a_short_audit_selector() {
    let db = TestDb::new().await;
    let rows: Vec<_> = (0..901)
        .map(|i| message(TOPIC, &format!("bulk-{i:04}"), &[]))
        .collect();
    enqueue(&db.pool, &rows).await;
    let (_console, addr) = console(&db, &["--actions", "--local-user", "alice@example.com"]).await;
    let listed = http_request(&addr, "GET", &format!("/pending?topic={TOPIC}"), &[], "").await;
    assert_eq!(listed.status, 200, "{}", listed.body);
    let form = format!(
        "action=cancel&scope=filter&topic={TOPIC}&reason=retired&csrf={}",
        csrf_of(&listed.body)
    );
    let preview = http_request(&addr, "POST", "/actions/preview", &[], &form).await;
    assert_eq!(preview.status, 200, "{}", preview.body);
    assert!(
        preview.body.contains("<strong id=\"count\">901</strong>"),
        "the preview counts all 901: {}",
        &preview.body[..preview.body.len().min(3000)]
    );
    let ids = confirmed_ids(&preview.body);
    assert_eq!(
        ids.len(),
        901,
        "the confirmation carries every previewed id"
    );
    let mut confirm = format!(
        "action=cancel&scope=ids&reason=retired&csrf={}",
        csrf_of(&preview.body)
    );
    for id in &ids {
        confirm.push_str(&format!("&id={id}"));
    }
    let done = http_request(&addr, "POST", "/actions/apply", &[], &confirm).await;
    assert_eq!(done.status, 200, "{}", done.body);
    assert!(done.body.contains("cancelled 901"), "{}", done.body);
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM pubsub_outbox").await,
        0,
        "every one cancelled"
    );
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM pubsub_outbox_dead_letter WHERE error_kind = 'cancelled'"
        )
        .await,
        901
    );
    let audited: Vec<(i32, i32)> = sqlx::query_as(
        "SELECT row_count, length(selector::text) FROM pubsub_outbox_audit WHERE action = 'cancel'",
    )
    .fetch_all(&db.pool)
    .await
    .expect("the audit rows");
    assert_eq!(
        audited.iter().map(|(n, _)| n).sum::<i32>(),
        901,
        "the audit counts each once: {audited:?}"
    );
    assert!(
        audited.iter().all(|(_, len)| *len < 200),
        "the selector is short (the ids are the row's row_ids): {audited:?}"
    );
}
