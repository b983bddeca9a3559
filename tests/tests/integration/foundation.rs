//! Foundation tests.
