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
