//! Releases: which one a dispatcher runs (its heartbeat's `version`), how they compare, and what
//! an older one misreads (docs/releases.md, "The promise"). A change to the outbox that an older
//! release would read wrong is a [`Feature`] here, with the first release that reads it right;
//! the command that would use it refuses while a replica of an older release is alive.

use std::cmp::Ordering;
use std::fmt;

/// A release's version, `major.minor.patch[-pre]` (semver precedence; build metadata ignored).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Release {
    /// The numbers.
    pub numbers: (u64, u64, u64),
    /// A pre-release (`0.2.0-dev`: the work towards 0.2.0), which precedes the release.
    pub pre: Option<String>,
}

impl Release {
    /// Parses a version; `None` for anything that is not one.
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.split('+').next().unwrap_or(s).trim();
        let (core, pre) = match s.split_once('-') {
            Some((core, pre)) if !pre.is_empty() => (core, Some(pre.to_owned())),
            Some(_) => return None,
            None => (s, None),
        };
        let mut parts = core.split('.').map(|p| p.parse::<u64>().ok());
        let numbers = (parts.next()??, parts.next()??, parts.next()??);
        parts.next().is_none().then_some(Self { numbers, pre })
    }
}

impl Ord for Release {
    fn cmp(&self, other: &Self) -> Ordering {
        self.numbers
            .cmp(&other.numbers)
            .then_with(|| match (&self.pre, &other.pre) {
                (None, None) => Ordering::Equal,
                (None, Some(_)) => Ordering::Greater,
                (Some(_), None) => Ordering::Less,
                (Some(a), Some(b)) => a.cmp(b),
            })
    }
}

impl PartialOrd for Release {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Display for Release {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (a, b, c) = self.numbers;
        write!(f, "{a}.{b}.{c}")?;
        if let Some(pre) = &self.pre {
            write!(f, "-{pre}")?;
        }
        Ok(())
    }
}

/// Something in the outbox a dispatcher of an older release reads wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Feature {
    /// A `cancelled` dead letter of a keyed row: a dispatcher before it holds the key behind it
    /// as behind any dead letter.
    CancelKeyed,
}

impl Feature {
    /// The first release that reads it right.
    pub fn since(self) -> Release {
        match self {
            Self::CancelKeyed => Release {
                numbers: (0, 1, 0),
                pre: None,
            },
        }
    }

    /// What it is, for messages.
    pub fn what(self) -> &'static str {
        match self {
            Self::CancelKeyed => "a cancelled message of an ordering key",
        }
    }

    /// What an older release does with it, for messages.
    pub fn misread(self) -> &'static str {
        match self {
            Self::CancelKeyed => {
                "does not know the `cancelled` kind and would hold the key's later messages \
                 behind it as behind any dead letter"
            }
        }
    }

    /// Whether a dispatcher reporting `version` reads it right (a version that does not parse,
    /// a build of no release, is taken as one that does not).
    pub fn known_to(self, version: &str) -> bool {
        Release::parse(version).is_some_and(|r| r >= self.since())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(s: &str) -> Release {
        Release::parse(s).expect(s)
    }

    #[test]
    fn versions_compare_as_semver() {
        assert!(r("0.2.0-dev") > r("0.1.0"));
        assert!(r("0.2.0-dev") < r("0.2.0"));
        assert!(r("0.10.0") > r("0.9.3"));
        assert_eq!(r("1.2.3+abc"), r("1.2.3"));
        assert_eq!(r("0.2.0-dev").to_string(), "0.2.0-dev");
        for bad in ["", "1", "1.2", "1.2.3.4", "1.2.x", "1.2.3-", "unknown"] {
            assert_eq!(Release::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_feature_is_known_from_its_release_on() {
        let f = Feature::CancelKeyed;
        assert!(f.known_to("0.1.0"));
        assert!(f.known_to("0.2.0-dev"));
        assert!(!f.known_to("0.0.9"));
        assert!(!f.known_to("0.1.0-rc.1"));
        assert!(!f.known_to("a build of no release"));
    }
}
