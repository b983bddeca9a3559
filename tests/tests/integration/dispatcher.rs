//! Dispatcher tests.
