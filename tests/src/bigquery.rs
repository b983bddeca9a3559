//! bqemulator helpers (dataset/table creation, row inserts).
