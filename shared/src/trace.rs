//! The writer's W3C trace context (www.w3.org/TR/trace-context), carried through the outbox.
//!
//! A writer that enqueues inside a traced transaction stores its `traceparent` (and
//! `tracestate`) with the message ([`TraceContext`], the columns `pubsub_outbox.traceparent` and
//! `tracestate`). The dispatcher publishes it as the attribute [`TRACEPARENT_ATTRIBUTE`], which
//! is where Google's Pub/Sub client libraries carry the context, so the consumer's handler
//! continues the same trace. Plain strings: this crate depends on no OpenTelemetry SDK; the
//! binaries and the inbox turn a parsed [`TraceParent`] into their spans' parents.

use std::fmt;

/// The Pub/Sub attribute carrying the W3C `traceparent` (the name Google's client libraries use).
pub const TRACEPARENT_ATTRIBUTE: &str = "googclient_traceparent";
/// The Pub/Sub attribute carrying the W3C `tracestate`.
pub const TRACESTATE_ATTRIBUTE: &str = "googclient_tracestate";

/// A version 00 `traceparent`'s length: `00-` and 32, 1 and 16, 1 and 2 characters.
const VERSION_00_LEN: usize = 55;

/// The longest `tracestate` carried (W3C: 32 list members; 512 bytes is what propagators keep).
pub const MAX_TRACESTATE_BYTES: usize = 512;

/// A message's trace context, as the writer's propagator wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    /// `00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`.
    pub traceparent: String,
    /// The vendors' list (`key=value,…`), if any.
    pub tracestate: Option<String>,
}

impl TraceContext {
    /// A context of `traceparent` alone.
    pub fn new(traceparent: impl Into<String>) -> Self {
        Self {
            traceparent: traceparent.into(),
            tracestate: None,
        }
    }

    /// With a `tracestate` (an empty one is none).
    pub fn with_tracestate(mut self, tracestate: impl Into<String>) -> Self {
        self.tracestate = Some(tracestate.into()).filter(|s| !s.is_empty());
        self
    }

    /// The context's parsed `traceparent`.
    pub fn parse(&self) -> Result<TraceParent, InvalidTraceParent> {
        TraceParent::parse(&self.traceparent)
    }

    /// The context as it is carried on (the dispatcher's publish): its `traceparent` parsed and,
    /// when a later version appended fields, rewritten in version 00's form; a `tracestate` not
    /// worth carrying ([`Self::valid_tracestate`]) dropped. An invalid `traceparent` is left as it
    /// is, and the error says why.
    pub fn normalize(&mut self) -> Result<TraceParent, InvalidTraceParent> {
        let parent = self.parse()?;
        if self.traceparent.len() != VERSION_00_LEN {
            self.traceparent = parent.to_string();
        }
        if self.tracestate.is_some() && self.valid_tracestate().is_none() {
            self.tracestate = None;
        }
        Ok(parent)
    }

    /// The `tracestate` worth carrying: printable ASCII of at most [`MAX_TRACESTATE_BYTES`].
    pub fn valid_tracestate(&self) -> Option<&str> {
        self.tracestate.as_deref().filter(|s| {
            !s.is_empty()
                && s.len() <= MAX_TRACESTATE_BYTES
                && s.bytes().all(|b| (0x20..=0x7e).contains(&b))
        })
    }
}

/// A parsed `traceparent`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceParent {
    /// The trace id (never all zero).
    pub trace_id: [u8; 16],
    /// The parent span's id (never all zero).
    pub span_id: [u8; 8],
    /// The trace flags (bit 0: sampled).
    pub flags: u8,
}

/// Why a `traceparent` is not one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{value:?} is not a W3C traceparent ({why}); write 00-<32 lowercase hex>-<16 lowercase hex>-<2 hex>, as an OpenTelemetry propagator does"
)]
pub struct InvalidTraceParent {
    /// The value (at most 64 characters of it).
    pub value: String,
    /// The rule it breaks.
    pub why: &'static str,
}

impl TraceParent {
    /// Parses a `traceparent` as the W3C recommendation reads one: version 00 is exactly 55
    /// characters; a later version may append fields after a dash, which are ignored; `ff` is
    /// not a version; ids are lowercase hex and never all zero.
    pub fn parse(value: &str) -> Result<Self, InvalidTraceParent> {
        let invalid = |why| InvalidTraceParent {
            value: value.chars().take(64).collect(),
            why,
        };
        let b = value.as_bytes();
        if b.len() < VERSION_00_LEN {
            return Err(invalid("shorter than 55 characters"));
        }
        if b[2] != b'-' || b[35] != b'-' || b[52] != b'-' {
            return Err(invalid(
                "fields are not separated by dashes where they should be",
            ));
        }
        let version = hex::<1>(&b[0..2]).ok_or_else(|| invalid("the version is not hex"))?[0];
        if version == 0xff {
            return Err(invalid("version ff is invalid"));
        }
        if version == 0 && b.len() != VERSION_00_LEN {
            return Err(invalid("version 00 is exactly 55 characters"));
        }
        if version != 0 && b.len() > VERSION_00_LEN && b[VERSION_00_LEN] != b'-' {
            return Err(invalid("characters follow the flags without a dash"));
        }
        let trace_id =
            hex::<16>(&b[3..35]).ok_or_else(|| invalid("the trace id is not lowercase hex"))?;
        let span_id =
            hex::<8>(&b[36..52]).ok_or_else(|| invalid("the parent id is not lowercase hex"))?;
        let flags = hex::<1>(&b[53..55]).ok_or_else(|| invalid("the flags are not hex"))?[0];
        if trace_id == [0; 16] {
            return Err(invalid("the trace id is all zero"));
        }
        if span_id == [0; 8] {
            return Err(invalid("the parent id is all zero"));
        }
        Ok(Self {
            trace_id,
            span_id,
            flags,
        })
    }

    /// Whether the writer sampled its trace (flag bit 0).
    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }
}

/// Version 00's text form.
impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("00-")?;
        for b in self.trace_id {
            write!(f, "{b:02x}")?;
        }
        f.write_str("-")?;
        for b in self.span_id {
            write!(f, "{b:02x}")?;
        }
        write!(f, "-{:02x}", self.flags)
    }
}

/// `N` bytes from `2·N` lowercase hex digits.
fn hex<const N: usize>(digits: &[u8]) -> Option<[u8; N]> {
    let nibble = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let mut out = [0u8; N];
    for (i, pair) in digits.chunks_exact(2).enumerate() {
        out[i] = nibble(pair[0])? << 4 | nibble(pair[1])?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_parses_and_prints_back() {
        let p = TraceParent::parse(VALID).expect("valid");
        assert!(p.sampled());
        assert_eq!(p.span_id, [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7]);
        assert_eq!(p.to_string(), VALID);
        let later = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-what-follows";
        let p = TraceParent::parse(later).expect("a later version's extra fields are ignored");
        assert!(!p.sampled());
    }

    #[test]
    fn malformed_traceparents_are_refused_with_the_rule() {
        for (bad, why) in [
            ("", "shorter"),
            ("garbage", "shorter"),
            (
                "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
                "trace id",
            ),
            (
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                "all zero",
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
                "all zero",
            ),
            (
                "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "ff",
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
                "exactly 55",
            ),
            (
                "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "dashes",
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-zz",
                "flags",
            ),
        ] {
            let e = TraceParent::parse(bad).expect_err(bad);
            assert!(e.why.contains(why), "{bad:?}: {e}");
            assert!(e.to_string().contains("00-<32 lowercase hex>"), "{e}");
        }
    }

    #[test]
    fn a_tracestate_is_carried_only_when_printable_and_short() {
        let c = TraceContext::new(VALID).with_tracestate("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7");
        assert_eq!(
            c.valid_tracestate(),
            Some("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7")
        );
        assert_eq!(
            TraceContext::new(VALID).with_tracestate("").tracestate,
            None
        );
        let long = TraceContext::new(VALID).with_tracestate("a=".to_owned() + &"b".repeat(600));
        assert_eq!(long.valid_tracestate(), None);
        let binary = TraceContext::new(VALID).with_tracestate("a=\u{7}");
        assert_eq!(binary.valid_tracestate(), None);
    }

    #[test]
    fn normalizing_keeps_version_00_rewrites_a_later_one_and_drops_a_bad_tracestate() {
        let mut same = TraceContext::new(VALID).with_tracestate("congo=t61rcWkgMzE");
        assert!(same.normalize().is_ok());
        assert_eq!(
            same,
            TraceContext::new(VALID).with_tracestate("congo=t61rcWkgMzE")
        );
        let later = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-follows";
        let mut c = TraceContext::new(later).with_tracestate("a=\u{7}");
        c.normalize().expect("a later version parses");
        assert_eq!(c.traceparent, VALID, "in version 00's form");
        assert_eq!(c.tracestate, None, "not worth carrying");
        let mut bad = TraceContext::new("garbage");
        assert!(bad.normalize().is_err());
        assert_eq!(bad.traceparent, "garbage", "left as it is");
    }
}
