//! The decoder (being written).

/// The decoder's activations and scratch (being written).
#[derive(Debug)]
pub struct Llama {}
