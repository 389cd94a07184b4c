//! The model's shape (being written).

/// The shape of a Llama-family decoder (being written).
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {}
