//! Producer tests.
