//! Row → message mapping: keys, topics, attributes, payload forms, rejections, schema checks.

use std::collections::BTreeMap;

use gcp_bigquery_client::model::field_type::FieldType;
use gcp_bigquery_client::model::table_cell::TableCell;
use serde_json::json;

use gcp_bigquery_client::model::table_schema::TableSchema;

use super::*;
use crate::config::{CursorSpec, PayloadSpec};

fn stream() -> Stream {
    Stream {
        name: "orders".into(),
        query: "SELECT … @watermark_ts @watermark_key".into(),
        location: None,
        maximum_bytes_billed: None,
        lookback: None,
        cursor: CursorSpec {
            timestamp_column: "ts_micros".into(),
            key_column: "id".into(),
            key_type: KeyType::Int64,
        },
        dedupe_key: vec!["id".into(), "ts_micros".into()],
        topic: TopicSpec::Fixed("projects/test-project/topics/orders".into()),
        ordering_key_column: Some("customer".into()),
        attribute_columns: BTreeMap::from([("status".into(), "status".into())]),
        fixed_attributes: BTreeMap::from([("source".into(), "bq".into())]),
        payload: PayloadSpec::Columns(vec!["id".into(), "status".into(), "amount".into()]),
        commit: crate::config::Commit::Page,
    }
}

fn schema() -> TableSchema {
    TableSchema::new(vec![
        TableFieldSchema::integer("id"),
        TableFieldSchema::integer("ts_micros"),
        TableFieldSchema::string("customer"),
        TableFieldSchema::string("status"),
        TableFieldSchema::numeric("amount"),
        TableFieldSchema::string("topic"),
        TableFieldSchema::bytes("raw"),
    ])
}

fn row(cells: &[serde_json::Value]) -> TableRow {
    TableRow {
        columns: Some(
            cells
                .iter()
                .map(|v| TableCell {
                    value: Some(v.clone()),
                })
                .collect(),
        ),
    }
}

fn typical() -> TableRow {
    row(&[
        json!("42"),
        json!("1000"),
        json!("c-1"),
        json!("paid"),
        json!("12.500"),
        json!("orders-2"),
        json!("aGk="),
    ])
}

#[test]
fn a_row_becomes_a_message_as_configured() {
    let s = stream();
    let m = Mapper::new(&s, &schema(), "dedupe_key", "test-project").expect("columns resolve");
    let mapped = m.map_row(&typical()).expect("row maps");
    assert_eq!(
        mapped.position,
        Position {
            micros: 1000,
            key: Key::Int(42)
        }
    );
    let msg = mapped.outcome.expect("publishable");
    assert_eq!(msg.topic, "projects/test-project/topics/orders");
    assert_eq!(msg.ordering_key.as_deref(), Some("c-1"));
    assert_eq!(msg.dedupe_key, "orders:42:1000");
    assert_eq!(
        msg.attributes,
        Attributes::from([
            ("source".into(), "bq".into()),
            ("status".into(), "paid".into())
        ])
    );
    let payload: serde_json::Value = serde_json::from_slice(&msg.payload).expect("JSON payload");
    assert_eq!(
        payload,
        json!({"id": "42", "status": "paid", "amount": "12.5"})
    );
}

#[test]
fn dedupe_keys_escape_separators_so_distinct_rows_never_collide() {
    let mut s = stream();
    s.dedupe_key = vec!["customer".into(), "status".into()];
    let m = Mapper::new(&s, &schema(), "dedupe_key", "test-project").expect("columns resolve");
    let key = |customer: &str, status: &str| {
        let r = row(&[
            json!("1"),
            json!("1"),
            json!(customer),
            json!(status),
            json!(null),
            json!(null),
            json!(null),
        ]);
        m.map_row(&r)
            .expect("maps")
            .outcome
            .expect("publishable")
            .dedupe_key
    };
    assert_ne!(key("a:b", "c"), key("a", "b:c"));
    assert_eq!(key("a:b", "c"), "orders:a%3Ab:c");
    assert_eq!(key("50%", "x"), "orders:50%25:x");
}

#[test]
fn topics_come_from_a_column_and_bad_ones_are_rejected() {
    let mut s = stream();
    s.topic = TopicSpec::Column("topic".into());
    let m = Mapper::new(&s, &schema(), "dedupe_key", "test-project").expect("columns resolve");
    let with_topic = |t: serde_json::Value| {
        let r = row(&[
            json!("1"),
            json!("1"),
            json!(null),
            json!(null),
            json!(null),
            t,
            json!(null),
        ]);
        m.map_row(&r).expect("maps")
    };
    assert_eq!(
        with_topic(json!("orders-2"))
            .outcome
            .expect("short name")
            .topic,
        "projects/test-project/topics/orders-2"
    );
    assert_eq!(
        with_topic(json!("projects/billing-prod/topics/orders-3"))
            .outcome
            .expect("full name")
            .topic,
        "projects/billing-prod/topics/orders-3"
    );
    for bad in [
        json!(null),
        json!(""),
        json!("a/b"),
        json!("projects/q/subscriptions/s"),
        json!("projects/billing-prod/topics/goog-orders"),
    ] {
        let rejection = with_topic(bad.clone())
            .outcome
            .expect_err("no usable topic");
        assert!(
            rejection.reason.contains("topic"),
            "{bad}: {}",
            rejection.reason
        );
    }
}

#[test]
fn raw_payloads_are_decoded_bytes_or_utf8_text() {
    let mut s = stream();
    s.payload = PayloadSpec::Raw("raw".into());
    let m = Mapper::new(&s, &schema(), "dedupe_key", "test-project").expect("columns resolve");
    assert_eq!(
        m.map_row(&typical())
            .expect("maps")
            .outcome
            .expect("ok")
            .payload,
        b"hi"
    );
    s.payload = PayloadSpec::Raw("status".into());
    let m = Mapper::new(&s, &schema(), "dedupe_key", "test-project").expect("columns resolve");
    assert_eq!(
        m.map_row(&typical())
            .expect("maps")
            .outcome
            .expect("ok")
            .payload,
        b"paid"
    );
    s.payload = PayloadSpec::Raw("amount".into());
    let err = Mapper::new(&s, &schema(), "dedupe_key", "test-project")
        .expect_err("NUMERIC is not a raw payload");
    assert!(err.to_string().contains("payload.raw_column"), "{err}");
}

#[test]
fn unpublishable_rows_are_rejected_with_the_reason() {
    let mut s = stream();
    s.payload = PayloadSpec::Columns(vec!["id".into(), "topic".into()]);
    let m = Mapper::new(&s, &schema(), "dedupe_key", "test-project").expect("columns resolve");
    let big = "x".repeat(10_000_001);
    let long_key = "k".repeat(1025);
    let long_attr = "v".repeat(1025);
    let cases = [
        (
            row(&[
                json!("1"),
                json!("1"),
                json!(null),
                json!(null),
                json!(null),
                json!(big),
                json!(null),
            ]),
            "10000000",
        ),
        (
            row(&[
                json!("1"),
                json!("1"),
                json!(long_key),
                json!(null),
                json!(null),
                json!(null),
                json!(null),
            ]),
            "ordering key",
        ),
        (
            row(&[
                json!("1"),
                json!("1"),
                json!(null),
                json!(long_attr),
                json!(null),
                json!(null),
                json!(null),
            ]),
            "attribute \"status\"",
        ),
    ];
    for (r, want) in cases {
        let rejection = m.map_row(&r).expect("maps").outcome.expect_err("rejected");
        assert!(
            rejection.reason.contains(want),
            "reason {:?} should mention {want}",
            rejection.reason
        );
        assert_eq!(rejection.message.dedupe_key, "orders:1:1");
    }
}

#[test]
fn a_null_dedupe_column_is_rejected_under_a_key_derived_from_the_cursor() {
    let mut s = stream();
    s.dedupe_key = vec!["status".into()];
    let m = Mapper::new(&s, &schema(), "dedupe_key", "test-project").expect("columns resolve");
    let r = row(&[
        json!("7"),
        json!("99"),
        json!(null),
        json!(null),
        json!(null),
        json!(null),
        json!(null),
    ]);
    let rejection = m
        .map_row(&r)
        .expect("maps")
        .outcome
        .expect_err("missing dedupe key");
    assert!(
        rejection.reason.contains("`status` is NULL"),
        "{}",
        rejection.reason
    );
    assert_eq!(
        rejection.message.dedupe_key,
        "orders:missing-dedupe-key:99:7"
    );
}

#[test]
fn unknown_columns_and_wrong_cursor_types_are_named() {
    let mut s = stream();
    s.attribute_columns.insert("region".into(), "regoin".into());
    let err = Mapper::new(&s, &schema(), "dedupe_key", "test-project").expect_err("unknown column");
    let text = err.to_string();
    assert!(
        text.contains("stream 'orders'")
            && text.contains("`regoin`")
            && text.contains("attributes.columns.region"),
        "{text}"
    );

    let mut s = stream();
    s.cursor.timestamp_column = "customer".into();
    let err = Mapper::new(&s, &schema(), "dedupe_key", "test-project").expect_err("STRING cursor");
    assert!(err.to_string().contains("UNIX_MICROS"), "{err}");

    let mut ts = schema();
    if let Some(f) = ts.fields.as_mut() {
        f[1] = TableFieldSchema::new("ts_micros", FieldType::Timestamp);
    }
    let s = stream();
    let err = Mapper::new(&s, &ts, "dedupe_key", "test-project").expect_err("TIMESTAMP cursor");
    assert!(
        err.to_string().contains("is TIMESTAMP, expected INT64"),
        "{err}"
    );
}

#[test]
fn a_null_cursor_fails_the_row_instead_of_losing_it() {
    let s = stream();
    let m = Mapper::new(&s, &schema(), "dedupe_key", "test-project").expect("columns resolve");
    let r = row(&[
        json!("1"),
        json!(null),
        json!(null),
        json!(null),
        json!(null),
        json!(null),
        json!(null),
    ]);
    let err = m.map_row(&r).expect_err("NULL cursor");
    assert!(err.to_string().contains("`ts_micros`"), "{err}");
}
