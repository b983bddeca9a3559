//! The two Pub/Sub messages the dispatcher sends, on the wire: `google.pubsub.v1.PublishRequest`
//! (and the `GetTopicRequest` of the probe) encoded straight from the claimed rows, and the
//! answers decoded with `prost`.
//!
//! Why by hand rather than a generated crate: the dispatcher sends two requests of three fields
//! each, whose field numbers protobuf never reuses; encoding from [`ClaimedMessage`] directly
//! needs no intermediate message (no copy of an attribute map per message) and knows a request's
//! exact size before it is sent, which is how requests are kept under Pub/Sub's 10 MB. A
//! generated crate would compile every Pub/Sub message and service for these five fields.
//! The test below decodes what is encoded here with `prost`-derived copies of the `.proto`
//! definitions.

use std::marker::PhantomData;

use bytes::{BufMut, Bytes, BytesMut};
use outbox_shared::ClaimedMessage;
use outbox_shared::trace::{TRACEPARENT_ATTRIBUTE, TRACESTATE_ATTRIBUTE};
use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint, key_len};
use tonic::Status;
use tonic::codec::{DecodeBuf, Decoder, EncodeBuf, Encoder};

/// `Publisher/Publish`.
pub(crate) const PUBLISH: &str = "/google.pubsub.v1.Publisher/Publish";
/// `Publisher/GetTopic` (the probe).
pub(crate) const GET_TOPIC: &str = "/google.pubsub.v1.Publisher/GetTopic";

/// `google.pubsub.v1.PublishResponse`: the ids of the published messages, in request order.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct PublishResponse {
    #[prost(string, repeated, tag = "1")]
    pub message_ids: Vec<String>,
}

/// `google.pubsub.v1.Topic`, whose fields the probe ignores (an answer is all it asks for).
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Topic {}

/// A length-delimited field's size: its key, its length and its bytes.
fn field_len(tag: u32, len: usize) -> usize {
    key_len(tag) + encoded_len_varint(len as u64) + len
}

fn put_field(tag: u32, value: &[u8], buf: &mut impl BufMut) {
    encode_key(tag, WireType::LengthDelimited, buf);
    encode_varint(value.len() as u64, buf);
    buf.put_slice(value);
}

/// One attribute's map entry (`key = 1`, `value = 2`).
fn entry_len(key: &str, value: &str) -> usize {
    field_len(1, key.len()) + field_len(2, value.len())
}

/// The size of `m` as a `PubsubMessage` (data = 1, attributes = 2, ordering_key = 5), with the
/// dedupe key as the attribute `dedupe_attribute` and its trace context as `googclient_traceparent`
/// (and `googclient_tracestate`). The context is vetted first (`crate::pubsub::trace::vet`): its
/// `traceparent` has version 00's 55 characters, as the send span's own does, so the size holds
/// whichever of the two is sent.
pub(crate) fn message_len(m: &ClaimedMessage, dedupe_attribute: &str) -> usize {
    let data = if m.payload.is_empty() {
        0
    } else {
        field_len(1, m.payload.len())
    };
    let attributes: usize = m
        .attributes
        .iter()
        .map(|(k, v)| field_len(2, entry_len(k, v)))
        .sum::<usize>()
        + field_len(2, entry_len(dedupe_attribute, &m.dedupe_key));
    let trace = m.trace_context.as_ref().map_or(0, |c| {
        field_len(2, entry_len(TRACEPARENT_ATTRIBUTE, &c.traceparent))
            + c.tracestate
                .as_deref()
                .map_or(0, |s| field_len(2, entry_len(TRACESTATE_ATTRIBUTE, s)))
    });
    let key = match m.ordering_key.as_deref() {
        Some(k) if !k.is_empty() => field_len(5, k.len()),
        _ => 0,
    };
    data + attributes + trace + key
}

/// The size a message of `len` bytes adds to a `PublishRequest` (`messages = 2`).
pub(crate) fn in_request_len(len: usize) -> usize {
    field_len(2, len)
}

/// The size of a `PublishRequest`'s topic field.
pub(crate) fn topic_len(topic: &str) -> usize {
    field_len(1, topic.len())
}

fn put_entry(key: &str, value: &str, buf: &mut BytesMut) {
    encode_key(2, WireType::LengthDelimited, buf);
    encode_varint(entry_len(key, value) as u64, buf);
    put_field(1, key.as_bytes(), buf);
    put_field(2, value.as_bytes(), buf);
}

/// `PublishRequest { topic, messages }` for `messages`, each with its [`message_len`] and the
/// `googclient_traceparent` of its own send span, if it has one (else its writer's is sent).
pub(crate) fn publish_request<'a>(
    topic: &str,
    messages: impl IntoIterator<Item = (&'a ClaimedMessage, usize, Option<&'a str>)>,
    dedupe_attribute: &str,
    size: usize,
) -> Bytes {
    let mut buf = BytesMut::with_capacity(size);
    put_field(1, topic.as_bytes(), &mut buf);
    for (m, len, traceparent) in messages {
        encode_key(2, WireType::LengthDelimited, &mut buf);
        encode_varint(len as u64, &mut buf);
        if !m.payload.is_empty() {
            put_field(1, &m.payload, &mut buf);
        }
        for (k, v) in &m.attributes {
            put_entry(k, v, &mut buf);
        }
        put_entry(dedupe_attribute, &m.dedupe_key, &mut buf);
        if let Some(c) = &m.trace_context {
            put_entry(
                TRACEPARENT_ATTRIBUTE,
                traceparent.unwrap_or(&c.traceparent),
                &mut buf,
            );
            if let Some(state) = c.tracestate.as_deref() {
                put_entry(TRACESTATE_ATTRIBUTE, state, &mut buf);
            }
        }
        if let Some(key) = m.ordering_key.as_deref().filter(|k| !k.is_empty()) {
            put_field(5, key.as_bytes(), &mut buf);
        }
    }
    buf.freeze()
}

/// `GetTopicRequest { topic }`.
pub(crate) fn get_topic_request(topic: &str) -> Bytes {
    let mut buf = BytesMut::with_capacity(topic_len(topic));
    put_field(1, topic.as_bytes(), &mut buf);
    buf.freeze()
}

/// tonic's codec for a request encoded here and an answer `R` decoded by `prost`.
#[derive(Debug)]
pub(crate) struct Codec<R>(PhantomData<fn() -> R>);

impl<R> Default for Codec<R> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<R: prost::Message + Default + Send + 'static> tonic::codec::Codec for Codec<R> {
    type Encode = Bytes;
    type Decode = R;
    type Encoder = Encoded;
    type Decoder = Answer<R>;

    fn encoder(&mut self) -> Encoded {
        Encoded
    }

    fn decoder(&mut self) -> Answer<R> {
        Answer(PhantomData)
    }
}

/// Writes an encoded request as it is.
#[derive(Debug)]
pub(crate) struct Encoded;

impl Encoder for Encoded {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.reserve(item.len());
        dst.put(item);
        Ok(())
    }
}

/// Decodes an answer with `prost`.
#[derive(Debug)]
pub(crate) struct Answer<R>(PhantomData<fn() -> R>);

impl<R: prost::Message + Default> Decoder for Answer<R> {
    type Item = R;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<R>, Status> {
        R::decode(src)
            .map(Some)
            .map_err(|e| Status::internal(format!("cannot decode Pub/Sub's answer: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use prost::Message as _;

    use super::*;

    /// `google/pubsub/v1/pubsub.proto`, the fields this module writes.
    #[derive(Clone, PartialEq, prost::Message)]
    struct PubsubMessage {
        #[prost(bytes = "vec", tag = "1")]
        data: Vec<u8>,
        #[prost(map = "string, string", tag = "2")]
        attributes: HashMap<String, String>,
        #[prost(string, tag = "3")]
        message_id: String,
        #[prost(string, tag = "5")]
        ordering_key: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    struct PublishRequest {
        #[prost(string, tag = "1")]
        topic: String,
        #[prost(message, repeated, tag = "2")]
        messages: Vec<PubsubMessage>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    struct GetTopicRequest {
        #[prost(string, tag = "1")]
        topic: String,
    }

    fn row(id: i64, key: Option<&str>, payload: &[u8], attrs: &[(&str, &str)]) -> ClaimedMessage {
        ClaimedMessage {
            id,
            topic: "projects/p/topics/t".to_owned(),
            ordering_key: key.map(str::to_owned),
            dedupe_key: format!("dedupe-{id}"),
            payload: Bytes::copy_from_slice(payload),
            attributes: attrs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            trace_context: None,
            attempts: 0,
            created_at: chrono::Utc::now(),
        }
    }

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn traced(id: i64, state: Option<&str>) -> ClaimedMessage {
        let mut context = outbox_shared::TraceContext::new(PARENT);
        context.tracestate = state.map(str::to_owned);
        ClaimedMessage {
            trace_context: Some(context),
            ..row(id, None, b"t", &[])
        }
    }

    #[test]
    fn a_publish_request_decodes_as_pubsubs_own_message_with_its_exact_size() {
        let big = vec![7u8; 300];
        let rows = [
            row(1, Some("k"), b"hello", &[("a", "1"), ("b", "")]),
            row(2, None, b"", &[]),
            row(3, Some(""), &big, &[("x", "y")]),
            traced(4, Some("congo=t61rcWkgMzE")),
            traced(5, None),
        ];
        let lens: Vec<usize> = rows.iter().map(|m| message_len(m, "dd")).collect();
        let size = topic_len("projects/p/topics/t")
            + lens.iter().map(|l| in_request_len(*l)).sum::<usize>();
        let own_span = "00-4bf92f3577b34da6a3ce929d0e0e4736-1111111111111111-01";
        let spans = [None, None, None, None, Some(own_span)];
        let bytes = publish_request(
            "projects/p/topics/t",
            rows.iter()
                .zip(lens.iter().copied())
                .zip(spans)
                .map(|((m, l), s)| (m, l, s)),
            "dd",
            size,
        );
        assert_eq!(bytes.len(), size, "the size is known before encoding");
        let request = PublishRequest::decode(bytes).expect("decodes");
        assert_eq!(request.topic, "projects/p/topics/t");
        assert_eq!(request.messages.len(), 5);
        let writers = &request.messages[3].attributes;
        assert_eq!(
            writers[TRACEPARENT_ATTRIBUTE], PARENT,
            "the writer's context"
        );
        assert_eq!(writers[TRACESTATE_ATTRIBUTE], "congo=t61rcWkgMzE");
        let own = &request.messages[4].attributes;
        assert_eq!(
            own[TRACEPARENT_ATTRIBUTE], own_span,
            "the send span's own context"
        );
        assert!(!own.contains_key(TRACESTATE_ATTRIBUTE));
        assert!(
            !request.messages[0]
                .attributes
                .contains_key(TRACEPARENT_ATTRIBUTE),
            "a row without a context sends no trace attribute"
        );
        let first = &request.messages[0];
        assert_eq!(first.data, b"hello");
        assert_eq!(first.ordering_key, "k");
        assert_eq!(first.attributes.len(), 3);
        assert_eq!(first.attributes["a"], "1");
        assert_eq!(first.attributes["b"], "");
        assert_eq!(first.attributes["dd"], "dedupe-1");
        assert!(request.messages[1].data.is_empty());
        assert_eq!(request.messages[1].ordering_key, "");
        assert_eq!(request.messages[1].attributes["dd"], "dedupe-2");
        assert_eq!(request.messages[2].data, big);
        assert_eq!(
            request.messages[2].ordering_key, "",
            "an empty key is no key"
        );
        // Not byte for byte what prost writes: prost leaves an entry's empty value out, this
        // module writes it (both are the same map on the wire).
        assert_eq!(request.messages[1].encoded_len(), lens[1]);
    }

    #[test]
    fn a_get_topic_request_and_a_publish_response_round_trip() {
        let request =
            GetTopicRequest::decode(get_topic_request("projects/p/topics/t")).expect("decodes");
        assert_eq!(request.topic, "projects/p/topics/t");
        let answer = PublishResponse {
            message_ids: vec!["1".into(), "2".into()],
        };
        let decoded = PublishResponse::decode(answer.encode_to_vec().as_slice()).expect("decodes");
        assert_eq!(decoded, answer);
    }
}
