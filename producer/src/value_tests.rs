//! Table-driven tests of the cell → JSON mapping (every type, both TIMESTAMP wire forms).

use gcp_bigquery_client::model::field_type::FieldType;
use gcp_bigquery_client::model::table_field_schema::TableFieldSchema;
use serde_json::{Value, json};

use super::*;

fn field(t: FieldType) -> TableFieldSchema {
    TableFieldSchema::new("c", t)
}

fn repeated(mut f: TableFieldSchema) -> TableFieldSchema {
    f.mode = Some("REPEATED".into());
    f
}

#[test]
fn scalars_map_to_json_without_loss() {
    let cases: Vec<(FieldType, Value, Value)> = vec![
        (
            FieldType::Integer,
            json!("9223372036854775807"),
            json!("9223372036854775807"),
        ),
        (
            FieldType::Int64,
            json!("-9223372036854775808"),
            json!("-9223372036854775808"),
        ),
        (FieldType::Integer, json!("007"), json!("7")),
        (FieldType::Numeric, json!("12.500000000"), json!("12.5")),
        (FieldType::Numeric, json!("-1E-9"), json!("-0.000000001")),
        (
            FieldType::Numeric,
            json!("99999999999999999999999999999.999999999"),
            json!("99999999999999999999999999999.999999999"),
        ),
        (
            FieldType::Bignumeric,
            json!("578960446186580977117854925043439539266.34992332820282019728792003956564819967"),
            json!("578960446186580977117854925043439539266.34992332820282019728792003956564819967"),
        ),
        (FieldType::Float, json!("1.5"), json!(1.5)),
        (FieldType::Float64, json!("0.1"), json!(0.1)),
        (
            FieldType::Float,
            json!("1.7976931348623157e+308"),
            json!(1.7976931348623157e308),
        ),
        (FieldType::Float, json!("5e-324"), json!(5e-324)),
        (FieldType::Float, json!("NaN"), json!("NaN")),
        (FieldType::Float, json!("nan"), json!("NaN")),
        (FieldType::Float, json!("Infinity"), json!("Infinity")),
        (FieldType::Float, json!("inf"), json!("Infinity")),
        (FieldType::Float, json!("-Infinity"), json!("-Infinity")),
        (FieldType::Float, json!("-inf"), json!("-Infinity")),
        (FieldType::Boolean, json!("true"), json!(true)),
        (FieldType::Bool, json!("false"), json!(false)),
        (FieldType::String, json!("héllo ☃"), json!("héllo ☃")),
        (FieldType::Bytes, json!("AAEC/w=="), json!("AAEC/w==")),
        (FieldType::Date, json!("2026-11-30"), json!("2026-11-30")),
        (
            FieldType::Time,
            json!("12:34:56.789012"),
            json!("12:34:56.789012"),
        ),
        (
            FieldType::Datetime,
            json!("2026-11-30T12:34:56.789012"),
            json!("2026-11-30T12:34:56.789012"),
        ),
        (
            FieldType::Geography,
            json!("POINT(1 2)"),
            json!("POINT(1 2)"),
        ),
        (
            FieldType::Geography,
            json!("POLYGON((0 0, 1 0, 1 1, 0 0))"),
            json!("POLYGON((0 0, 1 0, 1 1, 0 0))"),
        ),
        (
            FieldType::Json,
            json!("{\"a\":[1,2,{\"b\":null}],\"n\":-3.5}"),
            json!({"a": [1, 2, {"b": null}], "n": -3.5}),
        ),
        (
            FieldType::Json,
            json!("\"just a string\""),
            json!("just a string"),
        ),
        (
            FieldType::Interval,
            json!("1-2 3 4:5:6"),
            json!("1-2 3 4:5:6"),
        ),
    ];
    for (t, cell, want) in cases {
        let name = type_name(&t);
        assert_eq!(
            cell_to_json(&field(t), &cell),
            Ok(want),
            "{name} cell {cell}"
        );
    }
}

#[test]
fn timestamps_in_both_wire_forms_render_as_rfc3339_microseconds() {
    let cases = [
        // int64 microseconds: useInt64Timestamp / bqemulator
        ("1796040000123456", "2026-11-30T12:00:00.123456Z"),
        ("0", "1970-01-01T00:00:00.000000Z"),
        ("-62135596800000000", "0001-01-01T00:00:00.000000Z"),
        ("253402300799999999", "9999-12-31T23:59:59.999999Z"),
        // float seconds: real BigQuery's default
        ("1.7934912E9", "2026-11-01T00:00:00.000000Z"),
        ("1.796040000123456E9", "2026-11-30T12:00:00.123456Z"),
        ("-1.0E0", "1969-12-31T23:59:59.000000Z"),
    ];
    for (cell, want) in cases {
        assert_eq!(
            cell_to_json(&field(FieldType::Timestamp), &json!(cell)),
            Ok(json!(want)),
            "TIMESTAMP {cell}"
        );
    }
}

#[test]
fn nulls_nested_structs_and_arrays_keep_their_shape() {
    let schema = TableFieldSchema::record(
        "st",
        vec![
            TableFieldSchema::string("a"),
            repeated(TableFieldSchema::record(
                "xs",
                vec![TableFieldSchema::integer("k")],
            )),
            repeated(TableFieldSchema::new("ts", FieldType::Timestamp)),
            TableFieldSchema::numeric("n"),
        ],
    );
    let cell = json!({"f": [
        {"v": "x"},
        {"v": [{"v": {"f": [{"v": "1"}]}}, {"v": {"f": [{"v": null}]}}]},
        {"v": [{"v": "1.5E0"}, {"v": "2000000"}]},
        {"v": null}
    ]});
    let want = json!({
        "a": "x",
        "xs": [{"k": "1"}, {"k": null}],
        "ts": ["1970-01-01T00:00:01.500000Z", "1970-01-01T00:00:02.000000Z"],
        "n": null
    });
    assert_eq!(cell_to_json(&schema, &cell), Ok(want));
    assert_eq!(cell_to_json(&schema, &Value::Null), Ok(Value::Null));
    let ints = repeated(TableFieldSchema::integer("arr"));
    assert_eq!(cell_to_json(&ints, &json!([])), Ok(json!([])));
    assert_eq!(cell_to_json(&ints, &Value::Null), Ok(json!([])));
    assert_eq!(
        cell_to_json(&ints, &json!([{"v": "1"}, {"v": "2"}])),
        Ok(json!(["1", "2"]))
    );
}

#[test]
fn unexpected_wire_forms_are_errors_naming_the_column() {
    let bad: Vec<(TableFieldSchema, Value)> = vec![
        (field(FieldType::Integer), json!("1.5")),
        (field(FieldType::Numeric), json!("twelve")),
        (field(FieldType::Float), json!("fast")),
        (field(FieldType::Boolean), json!("yes")),
        (field(FieldType::Timestamp), json!("yesterday")),
        (field(FieldType::Json), json!("{not json")),
        (field(FieldType::String), json!({"f": []})),
        (
            TableFieldSchema::record("c", vec![TableFieldSchema::string("a")]),
            json!({"f": []}),
        ),
        (repeated(field(FieldType::String)), json!("not an array")),
    ];
    for (f, cell) in bad {
        let err = cell_to_json(&f, &cell).expect_err("malformed cell must be refused");
        assert!(err.path.starts_with('c'), "error names the column: {err}");
    }
}

#[test]
fn values_render_as_text_for_keys_and_attributes() {
    assert_eq!(as_text(&json!("a:b")), Some("a:b".into()));
    assert_eq!(as_text(&json!(true)), Some("true".into()));
    assert_eq!(as_text(&json!(1.5)), Some("1.5".into()));
    assert_eq!(as_text(&json!({"k": [1]})), Some("{\"k\":[1]}".into()));
    assert_eq!(as_text(&Value::Null), None);
}

#[test]
fn base64_decodes_with_and_without_padding() {
    assert_eq!(decode_base64("AAEC/w=="), Some(vec![0, 1, 2, 255]));
    assert_eq!(decode_base64("AAEC/w"), Some(vec![0, 1, 2, 255]));
    assert_eq!(decode_base64("aGVsbG8="), Some(b"hello".to_vec()));
    assert_eq!(decode_base64("aGVsbG8h"), Some(b"hello!".to_vec()));
    assert_eq!(decode_base64(""), Some(vec![]));
    assert_eq!(decode_base64("a"), None);
    assert_eq!(decode_base64("a$=="), None);
    assert_eq!(decode_base64("a==="), None);
}

/// The nearest double to `micros` / 10^6 seconds, as BigQuery's float form holds it.
fn float_seconds(micros: i64) -> f64 {
    let (secs, frac) = (micros.div_euclid(1_000_000), micros.rem_euclid(1_000_000));
    // Decimal text → f64 is correctly rounded; `secs + frac` keeps the sign right before 1970.
    let text = if secs < 0 && frac > 0 {
        format!("-{}.{:06}", -(secs + 1), 1_000_000 - frac)
    } else {
        format!("{secs}.{frac:06}")
    };
    text.parse().expect("decimal seconds parse")
}

fn timestamp_cell(text: &str) -> String {
    match cell_to_json(&field(FieldType::Timestamp), &json!(text)) {
        Ok(Value::String(s)) => s,
        other => panic!("TIMESTAMP {text:?} did not convert: {other:?}"),
    }
}

/// Asserts `s` is RFC 3339 with a four-digit year and returns its microseconds.
fn rfc3339_micros(s: &str) -> i64 {
    assert!(
        s.len() == 27 && s.as_bytes()[4] == b'-' && s.ends_with('Z'),
        "RFC 3339, four-digit year, microseconds: {s}"
    );
    chrono::DateTime::parse_from_rfc3339(s)
        .expect("parses as RFC 3339")
        .timestamp_micros()
}

#[test]
fn every_timestamp_from_year_1_to_9999_arrives_exact_in_int64_and_within_a_double_in_float() {
    let max = crate::decimal::MAX_TIMESTAMP_MICROS;
    let min = crate::decimal::MIN_TIMESTAMP_MICROS;
    // Named instants, then a deterministic sweep over the whole range.
    let mut instants = vec![
        min,                    // 0001-01-01 00:00:00
        min + 1,                // 0001-01-01 00:00:00.000001
        -2_208_988_800_000_001, // 1899-12-31 23:59:59.999999
        -1,                     // 1969-12-31 23:59:59.999999
        -500_000,               // 1969-12-31 23:59:59.5
        0,                      // 1970-01-01 00:00:00
        1,                      // 1970-01-01 00:00:00.000001
        1_796_040_000_123_456,  // 2026-11-30 12:00:00.123456
        8_589_934_591_999_999,  // just below 2^33 s (2242-03-16)
        10_413_792_000_000_003, // 2300-01-01 00:00:00.000003
        max,                    // 9999-12-31 23:59:59.999999
    ];
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let span = (max - min) as u64;
    for _ in 0..20_000 {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        instants.push(min + (x % span) as i64);
    }
    for t in instants {
        // int64 microseconds (what the producer asks for): exact everywhere.
        assert_eq!(
            rfc3339_micros(&timestamp_cell(&t.to_string())),
            t,
            "int64 {t}"
        );

        // float seconds, scientific ("1.0413792000000004E10") and plain ("1796040000.123456").
        let f = float_seconds(t);
        // Like Java's Double.toString, the plain form always has a point ("1.0E9" / "5.0").
        let plain = format!("{f}");
        let plain = if plain.contains('.') {
            plain
        } else {
            format!("{plain}.0")
        };
        for text in [format!("{f:E}"), plain] {
            let got = rfc3339_micros(&timestamp_cell(&text));
            if t.unsigned_abs() < (1u64 << 33) * 1_000_000 {
                assert_eq!(got, t, "float {text} below 2^33 s is exact");
            } else {
                // Above 2^33 s the double itself is coarser than a microsecond.
                let ulp_micros = (f.abs() * f64::EPSILON * 1e6).ceil() as i64;
                assert!(
                    (got - t).abs() <= ulp_micros,
                    "float {text}: {got} is within a double's spacing ({ulp_micros} µs) of {t}"
                );
            }
        }
    }
}

#[test]
fn the_open_ended_sentinel_and_far_future_floats_stay_valid_rfc3339() {
    // Real BigQuery's float form of 9999-12-31 23:59:59.999999 rounds one microsecond past the
    // end of the range; it is the end (and the int64 form is exact).
    for cell in ["2.534023008E11", "253402300800.0", "253402300799999999"] {
        assert_eq!(
            timestamp_cell(cell),
            "9999-12-31T23:59:59.999999Z",
            "{cell}"
        );
    }
    assert_eq!(
        timestamp_cell("-6.21355968E10"),
        "0001-01-01T00:00:00.000000Z"
    );
    // 2300-01-01 00:00:00.000003: exact in int64; the double only holds ~2 µs steps.
    assert_eq!(
        timestamp_cell("10413792000000003"),
        "2300-01-01T00:00:00.000003Z"
    );
    assert_eq!(
        timestamp_cell("1.0413792000000004E10"),
        "2300-01-01T00:00:00.000004Z"
    );
    // Beyond the range: refused, never a five-digit year.
    for cell in [
        "253402300800000000",
        "2.6E11",
        "-62135596800000001",
        "-6.3E10",
    ] {
        assert!(
            cell_to_json(&field(FieldType::Timestamp), &json!(cell)).is_err(),
            "{cell} is outside BigQuery's range"
        );
    }
}
