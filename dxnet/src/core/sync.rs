//! Placeholder until the loom shim lands.
